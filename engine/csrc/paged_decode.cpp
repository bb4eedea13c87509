// Single-token decode attention over the engine's paged KV pool, reading the blocks in place.
//
// paged_decode(q [B, H, D], k_blocks / v_blocks [KVH, num_blocks, block_size, D], block_tables
// int32 [B, W], context_lens int32 [B], scale, out [B, H, D]): row b's query head h attends to
// the first context_lens[b] tokens of KV head h / (H / KVH), stored in blocks block_tables[b, :].
// Online softmax in float32, one task per (row, KV head) over at::parallel_for, KV head major;
// float32 and bfloat16. The AVX-512 kernel (head_dim 16/32/64/128, 1/2/4/8 query heads per KV
// head) is chosen at run time; other CPUs and shapes take the portable loop. Built by
// engine/paged_kernel.py (torch cpp_extension), with plain -O3 -fopenmp.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DPMESH_X86 1
#endif

namespace {

constexpr int kMaxGroup = 16;  // query heads per KV head
constexpr int kMaxDim = 256;

struct Args {
  const void* q;
  int64_t q_s0, q_s1;  // row, head strides (elements); the last dim is contiguous
  const void* k;
  const void* v;
  int64_t kv_s0, kv_s1;  // KV head, block strides (elements); [block_size, D] contiguous
  const int32_t* tables;
  int64_t table_s0;
  const int32_t* lens;
  void* out;
  int64_t o_s0, o_s1;
  int64_t heads, kv_heads, block_size, dim, num_blocks;
  float scale;
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline void store(float* p, float x) { *p = x; }
inline void store(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }

// Portable: any head_dim, any CPU.
template <typename T>
void task_generic(const Args& a, int64_t b, int64_t kvh) {
  const int64_t group = a.heads / a.kv_heads, D = a.dim, bs = a.block_size;
  const int64_t len = a.lens[b];
  float qf[kMaxGroup][kMaxDim], acc[kMaxGroup][kMaxDim], m[kMaxGroup], l[kMaxGroup];
  float s[kMaxGroup][64];
  const T* q = static_cast<const T*>(a.q);
  for (int64_t g = 0; g < group; ++g) {
    const T* qr = q + b * a.q_s0 + (kvh * group + g) * a.q_s1;
    for (int64_t d = 0; d < D; ++d) {
      qf[g][d] = to_float(qr[d]) * a.scale;
      acc[g][d] = 0.f;
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  const T* kbase = static_cast<const T*>(a.k) + kvh * a.kv_s0;
  const T* vbase = static_cast<const T*>(a.v) + kvh * a.kv_s0;
  for (int64_t start = 0; start < len; start += bs) {
    const int64_t blk = a.tables[b * a.table_s0 + start / bs];
    TORCH_CHECK(blk >= 0 && blk < a.num_blocks, "paged_decode: block id out of range");
    const int64_t n = std::min(bs, len - start);
    for (int64_t c = 0; c < n; c += 64) {
      const int64_t nc = std::min<int64_t>(64, n - c);
      const T* kb = kbase + blk * a.kv_s1 + c * D;
      const T* vb = vbase + blk * a.kv_s1 + c * D;
      for (int64_t g = 0; g < group; ++g) {
        float mx = m[g];
        for (int64_t t = 0; t < nc; ++t) {
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qf[g][d] * to_float(kb[t * D + d]);
          s[g][t] = dot;
          mx = std::max(mx, dot);
        }
        const float corr = std::exp(m[g] - mx);
        l[g] *= corr;
        for (int64_t d = 0; d < D; ++d) acc[g][d] *= corr;
        for (int64_t t = 0; t < nc; ++t) {
          const float p = std::exp(s[g][t] - mx);
          l[g] += p;
          for (int64_t d = 0; d < D; ++d) acc[g][d] += p * to_float(vb[t * D + d]);
        }
        m[g] = mx;
      }
    }
  }
  T* o = static_cast<T*>(a.out);
  for (int64_t g = 0; g < group; ++g) {
    T* orow = o + b * a.o_s0 + (kvh * group + g) * a.o_s1;
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) store(orow + d, acc[g][d] * inv);
  }
}

#ifdef DPMESH_X86
#define AVX512 __attribute__((target("avx512f")))

template <typename T>
AVX512 inline __m512 load16(const T* p);
template <>
AVX512 inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
AVX512 inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 (and -inf), ~1 ulp: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2].
AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // exp underflows to 0 below ~-103.97
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// Row t of the result: the sum of v[t]'s 16 lanes (a transpose-and-add tree, 45 ops).
AVX512 inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// head_dim = 16 * VD; tokens in chunks of 16: one score vector per query head.
// G: the query heads per KV head, known at compile time (the scores stay in registers).
template <typename T, int VD, int G>
AVX512 void task_avx512(const Args& a, int64_t b, int64_t kvh) {
  constexpr int64_t group = G;
  const int64_t bs = a.block_size;
  constexpr int D = 16 * VD;
  const int64_t len = a.lens[b];
  __m512 qv[G][VD], acc[G][VD], l[G];  // l: per-lane partial sums
  float m[G];
  __m512 part[G][16];  // per head and key: the dot product's 16 lane partials
  alignas(64) float p[G][16];
  const T* q = static_cast<const T*>(a.q);
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < group; ++g) {
    const T* qr = q + b * a.q_s0 + (kvh * group + g) * a.q_s1;
    for (int j = 0; j < VD; ++j) {
      qv[g][j] = _mm512_mul_ps(load16(qr + 16 * j), scale);
      acc[g][j] = _mm512_setzero_ps();
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = _mm512_setzero_ps();
  }
  const T* kbase = static_cast<const T*>(a.k) + kvh * a.kv_s0;
  const T* vbase = static_cast<const T*>(a.v) + kvh * a.kv_s0;
  for (int64_t start = 0; start < len; start += bs) {
    const int64_t blk = a.tables[b * a.table_s0 + start / bs];
    TORCH_CHECK(blk >= 0 && blk < a.num_blocks, "paged_decode: block id out of range");
    const int64_t n = std::min(bs, len - start);
    if (start + bs < len) {  // the next block is elsewhere in the pool: prefetch it
      const int64_t next = a.tables[b * a.table_s0 + start / bs + 1];
      if (next >= 0 && next < a.num_blocks) {
        const char* nk = reinterpret_cast<const char*>(kbase + next * a.kv_s1);
        const char* nv = reinterpret_cast<const char*>(vbase + next * a.kv_s1);
        const int64_t bytes = std::min(bs, len - start - bs) * D * sizeof(T);
        for (int64_t off = 0; off < bytes; off += 64) {
          _mm_prefetch(nk + off, _MM_HINT_T0);
          _mm_prefetch(nv + off, _MM_HINT_T0);
        }
      }
    }
    for (int64_t c = 0; c < n; c += 16) {
      const int nc = static_cast<int>(std::min<int64_t>(16, n - c));
      const T* kb = kbase + blk * a.kv_s1 + c * D;
      const T* vb = vbase + blk * a.kv_s1 + c * D;
      const __mmask16 valid = static_cast<__mmask16>((1u << nc) - 1u);
      // scores: each key row loaded (and widened) once for all the group's heads
      // rows past the context within the block are read too (finite, masked out below)
      const int rows = c + 16 <= bs ? 16 : nc;
      for (int t = 0; t < 16; ++t) {
        if (t < rows) {
          __m512 kv[VD];
          for (int j = 0; j < VD; ++j) kv[j] = load16(kb + t * D + 16 * j);
          for (int64_t g = 0; g < group; ++g) {
            __m512 d = _mm512_mul_ps(qv[g][0], kv[0]);
            for (int j = 1; j < VD; ++j) d = _mm512_fmadd_ps(qv[g][j], kv[j], d);
            part[g][t] = d;
          }
        } else {
          for (int64_t g = 0; g < group; ++g) part[g][t] = _mm512_setzero_ps();
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const __m512 sv = _mm512_mask_mov_ps(neg_inf, valid, hsum16(part[g]));
        const float mx = std::max(m[g], _mm512_reduce_max_ps(sv));
        const __m512 mxv = _mm512_set1_ps(mx);
        const __m512 pv = exp512(_mm512_sub_ps(sv, mxv));  // 0 in the invalid lanes
        _mm512_store_ps(p[g], pv);
        // exp(-inf) (the first chunk) is 0 too: acc and l are still 0 then
        const __m512 cv = exp512(_mm512_sub_ps(_mm512_set1_ps(m[g]), mxv));
        l[g] = _mm512_fmadd_ps(l[g], cv, pv);
        m[g] = mx;
        for (int j = 0; j < VD; ++j) acc[g][j] = _mm512_mul_ps(acc[g][j], cv);
      }
      for (int t = 0; t < nc; ++t) {
        __m512 vv[VD];
        for (int j = 0; j < VD; ++j) vv[j] = load16(vb + t * D + 16 * j);
        for (int64_t g = 0; g < group; ++g) {
          const __m512 pt = _mm512_set1_ps(p[g][t]);
          for (int j = 0; j < VD; ++j) acc[g][j] = _mm512_fmadd_ps(pt, vv[j], acc[g][j]);
        }
      }
    }
  }
  T* o = static_cast<T*>(a.out);
  for (int64_t g = 0; g < group; ++g) {
    T* orow = o + b * a.o_s0 + (kvh * group + g) * a.o_s1;
    const float sum = _mm512_reduce_add_ps(l[g]);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    alignas(64) float res[D];
    for (int j = 0; j < VD; ++j)
      _mm512_store_ps(res + 16 * j, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inv)));
    for (int64_t d = 0; d < D; ++d) store(orow + d, res[d]);
  }
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}
#endif

template <typename T>
using TaskFn = void (*)(const Args&, int64_t, int64_t);

#ifdef DPMESH_X86
template <typename T, int VD>
TaskFn<T> pick_group(int64_t group) {
  switch (group) {
    case 1: return task_avx512<T, VD, 1>;
    case 2: return task_avx512<T, VD, 2>;
    case 4: return task_avx512<T, VD, 4>;
    case 8: return task_avx512<T, VD, 8>;
    default: return nullptr;
  }
}
#endif

// The AVX-512 kernel for head_dim 16/32/64/128 and 1/2/4/8 query heads per KV head on a CPU
// that has it; else the portable loop.
template <typename T>
TaskFn<T> pick(int64_t dim, int64_t group) {
  TaskFn<T> fn = nullptr;
#ifdef DPMESH_X86
  if (cpu_has_avx512()) {
    switch (dim) {
      case 16: fn = pick_group<T, 1>(group); break;
      case 32: fn = pick_group<T, 2>(group); break;
      case 64: fn = pick_group<T, 4>(group); break;
      case 128: fn = pick_group<T, 8>(group); break;
      default: break;
    }
  }
#endif
  return fn ? fn : task_generic<T>;
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_blocks, torch::Tensor v_blocks,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                           c10::optional<torch::Tensor> out_opt) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_blocks.dim() == 4 && v_blocks.dim() == 4, "paged_decode: shapes");
  TORCH_CHECK(k_blocks.sizes() == v_blocks.sizes() && k_blocks.strides() == v_blocks.strides(),
              "paged_decode: k and v blocks differ");
  TORCH_CHECK(q.scalar_type() == k_blocks.scalar_type() &&
                  q.scalar_type() == v_blocks.scalar_type(),
              "paged_decode: q, k and v dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 &&
                  context_lens.scalar_type() == torch::kInt32,
              "paged_decode: block_tables and context_lens must be int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_blocks.size(0), NB = k_blocks.size(1), BS = k_blocks.size(2);
  TORCH_CHECK(k_blocks.size(3) == D, "paged_decode: head_dim differs");
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && H / KVH <= kMaxGroup, "paged_decode: heads");
  TORCH_CHECK(D <= kMaxDim, "paged_decode: head_dim > 256");
  TORCH_CHECK(k_blocks.stride(3) == 1 && k_blocks.stride(2) == D,
              "paged_decode: each block must be a contiguous [block_size, head_dim]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B &&
                  block_tables.stride(1) == 1,
              "paged_decode: block_tables [B, W]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == B && context_lens.is_contiguous(),
              "paged_decode: context_lens [B]");
  if (q.stride(2) != 1) q = q.contiguous();
  torch::Tensor out = out_opt.has_value() ? *out_opt : torch::empty({B, H, D}, q.options());
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                  out.stride(2) == 1,
              "paged_decode: out [B, H, D], last dim contiguous");
  auto lens = context_lens.accessor<int32_t, 1>();
  const int64_t W = block_tables.size(1);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= W * BS, "paged_decode: context length > table");
  Args a{q.data_ptr(),
         q.stride(0),
         q.stride(1),
         k_blocks.data_ptr(),
         v_blocks.data_ptr(),
         k_blocks.stride(0),
         k_blocks.stride(1),
         block_tables.data_ptr<int32_t>(),
         block_tables.stride(0),
         context_lens.data_ptr<int32_t>(),
         out.data_ptr(),
         out.stride(0),
         out.stride(1),
         H,
         KVH,
         BS,
         D,
         NB,
         static_cast<float>(scale)};
  // KV head major: one head's blocks of all rows run back to back on a thread, so a prefix
  // that rows share stays in its cache between them
  auto launch = [&](auto fn) {
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) fn(a, i % B, i / B);
    });
  };
  if (q.scalar_type() == torch::kFloat32) {
    launch(pick<float>(D, H / KVH));
  } else if (q.scalar_type() == torch::kBFloat16) {
    launch(pick<c10::BFloat16>(D, H / KVH));
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only");
  }
  return out;
}

bool uses_avx512(int64_t dim, int64_t group) {
#ifdef DPMESH_X86
  return pick<float>(dim, group) != task_generic<float>;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "single-token decode attention over paged KV blocks",
        py::arg("q"), py::arg("k_blocks"), py::arg("v_blocks"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("out") = py::none());
  m.def("uses_avx512", &uses_avx512, py::arg("dim"), py::arg("group"));
}
