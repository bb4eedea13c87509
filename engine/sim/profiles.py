"""Simulation profiles: one hardware/model pair each, with the step-time coefficients, the KV
capacity of one rank and the limits a real engine on that pair would have.

The GPU profiles are rooflines pinned to published measurements, and the arithmetic is the code
below:

- ``base``: the published time per output token at concurrency 1 (a batch-1 decode step: reading
  the weights once, plus launch and sampling overhead). Dividing the weight bytes by it gives the
  bandwidth the engine really gets, ``mem_efficiency``.
- ``c`` (per context token): the KV bytes of one token read at that same effective bandwidth.
- ``a``, ``b`` (per prefill token, per decoding sequence): the token's matmul FLOPs (2 x the
  decoder-layer parameters; a decode also runs the LM head) at ``MFU`` of the dense BF16 peak.
  ``MFU`` = 0.6 is an assumption (no single published run isolates prefill throughput); the
  result, 25 us per decode sequence on an H100, matches the 26 us/sequence slope of NVIDIA's
  published ITL from concurrency 1 to 50.
- ``d`` (per prefill query-key pair): 4 * head_dim * heads * layers FLOPs at half the peak
  (FlashAttention forward).
- KV capacity: what vLLM would get, ``gpu_memory_utilization`` (0.9) x GPU memory - weights - a
  2 GiB reserve (the activation peak of its profiling run and CUDA graphs), over the KV bytes
  per token.
- ``max_num_seqs`` / ``max_num_batched_tokens``: vLLM's own defaults for that GPU in its OpenAI
  server (``EngineArgs.get_batch_defaults`` in vllm/engine/arg_utils.py: 1024 / 8192 for GPUs of
  70 GiB and more except A100, 256 / 2048 otherwise).

``cpu-tiny`` is fitted to our own engine by ``python -m engine.fit_step_time``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sim.step_time import StepCost

GiB = 2**30
KV_LINK_CPU_TINY = 450e6  # bytes/s: measured, python -m bench.runs.pd_transfer (docs/benchmarks.md)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
NON_KV_RESERVE_BYTES = 2 * GiB
MFU = 0.6
ATTENTION_EFFICIENCY = 0.5


@dataclass(frozen=True)
class Gpu:
    """Datasheet numbers of one GPU."""

    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    bf16_dense_flops: float
    source: str


@dataclass(frozen=True)
class ModelShape:
    """What the KV and FLOP arithmetic needs to know about a model (from its config.json)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    params: int  # all weights
    layer_params: int  # the decoder layers' weights: what every token multiplies by
    lm_head_params: int
    dtype_bytes: int
    max_model_len: int
    source: str

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def prefill_flops_per_token(self) -> float:
        return 2.0 * self.layer_params

    @property
    def decode_flops_per_seq(self) -> float:
        return 2.0 * (self.layer_params + self.lm_head_params)

    @property
    def flops_per_pair(self) -> float:
        return 4.0 * self.head_dim * self.num_heads * self.num_layers


@dataclass(frozen=True)
class Profile:
    """A named hardware/model pair: step-time coefficients, KV capacity, limits, sources."""

    name: str
    description: str
    cost: StepCost
    kv_tokens: int  # KV capacity of one rank, in tokens
    kv_bytes_per_token: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    sources: tuple[str, ...]
    # the engine's --long-prefill-token-threshold default (engine.scheduler): 0 (strict FCFS,
    # a running chunked prefill takes the whole budget) is vLLM's default and SGLang's behaviour,
    # so the GPU profiles model that; None is our own engine's (half the budget)
    long_prefill_token_threshold: int | None = None
    # prefill/decode disaggregation: what a KV pull between two ranks moves per second
    # (engine/kv_transfer.py; the simulated transfer takes KV bytes / this)
    kv_link_bytes_per_s: float = 50e9
    kv_link_source: str = (
        "one 400 Gb/s RDMA NIC per GPU (NVIDIA ConnectX-7 datasheet: up to 400 Gb/s), as "
        "NIXL and Mooncake use on DGX/HGX H100 nodes"
    )

    def transfer_seconds(self, tokens: int) -> float:
        """The modeled time to pull ``tokens`` tokens of KV from another rank."""
        return tokens * self.kv_bytes_per_token / self.kv_link_bytes_per_s

    def num_kv_blocks(self, block_size: int, kv_cache_memory: int | None = None) -> int:
        """KV blocks of one rank: the profile's capacity, or ``kv_cache_memory`` bytes of it."""
        tokens = self.kv_tokens
        if kv_cache_memory is not None:
            tokens = kv_cache_memory // self.kv_bytes_per_token
        return max(1, tokens // block_size)

    def summary(self) -> dict:
        """What /server_info reports about the simulation."""
        return {
            "profile": self.name,
            "description": self.description,
            "step_time": self.cost.as_dict(),
            "kv_tokens_per_rank": self.kv_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_link_bytes_per_s": self.kv_link_bytes_per_s,
            "sources": [*self.sources, self.kv_link_source],
        }


def kv_capacity_tokens(gpu: Gpu, model: ModelShape) -> int:
    """Tokens of KV one GPU holds once vLLM has loaded the weights (see the module docstring)."""
    free = GPU_MEMORY_UTILIZATION * gpu.memory_bytes - model.weight_bytes - NON_KV_RESERVE_BYTES
    return int(free // model.kv_bytes_per_token)


def roofline_cost(gpu: Gpu, model: ModelShape, tpot_at_concurrency_1_s: float) -> StepCost:
    """Step-time coefficients of ``model`` on ``gpu``, pinned to a measured batch-1 TPOT."""
    mem_efficiency = model.weight_bytes / gpu.hbm_bytes_per_s / tpot_at_concurrency_1_s
    flops = gpu.bf16_dense_flops
    return StepCost(
        base_s=tpot_at_concurrency_1_s,
        per_prefill_token_s=model.prefill_flops_per_token / (flops * MFU),
        per_decode_seq_s=model.decode_flops_per_seq / (flops * MFU),
        per_context_token_s=model.kv_bytes_per_token / (gpu.hbm_bytes_per_s * mem_efficiency),
        per_prefill_pair_s=model.flops_per_pair / (flops * ATTENTION_EFFICIENCY),
    )


H100_SXM = Gpu(
    "H100 SXM5 80GB",
    memory_bytes=80 * GiB,
    hbm_bytes_per_s=3.35e12,
    bf16_dense_flops=989.4e12,  # the datasheet's 1,979 TFLOPS is with sparsity
    source="https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 80 GB HBM3, 3.35 TB/s)",
)
A100_SXM_40GB = Gpu(
    "A100 SXM4 40GB",
    memory_bytes=40 * GiB,
    hbm_bytes_per_s=1.555e12,
    bf16_dense_flops=312e12,
    source="https://www.nvidia.com/en-us/data-center/a100/ (A100 40GB SXM: 1,555 GB/s, 312 TF)",
)
# 32 layers of 218,112,000 weights (q 4096x4096, k/v 4096x1024, o 4096x4096, MLP 3x4096x14336,
# two norms); embedding and LM head 128,256 x 4,096 each; 8,030,261,248 in all
LLAMA_31_8B = ModelShape(
    "Llama-3.1-8B-Instruct (BF16)",
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    params=8_030_261_248,
    layer_params=32 * 218_112_000,
    lm_head_params=128_256 * 4_096,
    dtype_bytes=2,
    max_model_len=131_072,
    source="https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json",
)


def _gpu_profile(name, gpu, model, tpot_s, max_num_seqs, max_num_batched_tokens, measured):
    return Profile(
        name=name,
        description=f"{model.name} on one {gpu.name}, vLLM-like serving",
        cost=roofline_cost(gpu, model, tpot_s),
        kv_tokens=kv_capacity_tokens(gpu, model),
        kv_bytes_per_token=model.kv_bytes_per_token,
        max_model_len=model.max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        sources=(measured, gpu.source, model.source),
        long_prefill_token_threshold=0,  # vLLM's default
    )


# H100: TPOT 6.48 ms at concurrency 1 (vLLM 0.21.0, fp16, H100-80GB-HBM3), so the engine gets
# 16.06 GB / 6.48 ms = 2.48 TB/s (74 % of 3.35). KV: 0.9 x 80 GiB - 14.96 GiB - 2 GiB
# = 55.04 GiB over 128 KiB/token = 450,907 tokens (28,181 blocks of 16).
H100_LLAMA_31_8B = _gpu_profile(
    "h100-llama3.1-8b",
    H100_SXM,
    LLAMA_31_8B,
    tpot_s=6.48e-3,
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    measured="https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/ (TPOT p50 6.48 ms "
    "at concurrency 1); ITL slope cross-check: "
    "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance",
)
# A100 40GB: 75 tokens/s at concurrency 1 (vLLM 0.23.0, BF16, 1024 in / 128 out), 13.33 ms per
# token = 1.20 TB/s (77 % of 1.555, as the page says). KV: 0.9 x 40 GiB - 14.96 GiB - 2 GiB
# = 19.04 GiB over 128 KiB/token = 155,995 tokens (9,749 blocks of 16).
A100_40GB_LLAMA_31_8B = _gpu_profile(
    "a100-40gb-llama3.1-8b",
    A100_SXM_40GB,
    LLAMA_31_8B,
    tpot_s=1 / 75,
    max_num_seqs=256,
    max_num_batched_tokens=2048,
    measured="https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on (75 tokens/s "
    "at concurrency 1, 77 % of the bandwidth ceiling)",
)

# Our own engine on the tiny model (engine.tiny: 6 layers, 4 KV heads of 32, float32), fitted
# by `python -m engine.sim.fit` (now `python -m engine.fit_step_time`; ``sources`` keeps the
# command as it was run) on 2026-12-01 on this project's box (2 vCPU AMD EPYC, 24 GiB,
# torch 2.13 CPU, one torch thread as a rank of a DP-2 server gets): 64 grid points (prefills of
# 16-1024 tokens after 0-768 cached, decode batches of 1-64 at contexts 16-1024, decodes with a
# 128-token prefill), RMS error 7.3 ms, mean 10.6 %, max 39 %, R^2 0.992.
# KV: the engine's default pool, 256 MiB / (2 x 6 x 4 x 32 x 4 B = 6,144 B/token) = 43,690
# tokens. Limits: the tiny model's 2,048 positions and the engine's own scheduler defaults.
CPU_TINY = Profile(
    name="cpu-tiny",
    description="the tiny model (engine.tiny) on our CPU engine, one torch thread per rank",
    cost=StepCost(
        base_s=5.056e-3,
        per_prefill_token_s=1.650e-4,
        per_decode_seq_s=3.611e-4,
        per_context_token_s=5.088e-6,
        per_prefill_pair_s=1.853e-7,
    ),
    kv_tokens=256 * 2**20 // 6144,
    kv_bytes_per_token=6144,
    max_model_len=2048,
    max_num_seqs=64,
    max_num_batched_tokens=512,
    sources=("python -m engine.sim.fit (2 vCPU, 2026-12-01)",),
    kv_link_bytes_per_s=KV_LINK_CPU_TINY,
    kv_link_source="our engine's own KV pull over loopback TCP (python -m bench.runs.pd_transfer)",
)

PROFILES: dict[str, Profile] = {
    p.name: p for p in (H100_LLAMA_31_8B, A100_40GB_LLAMA_31_8B, CPU_TINY)
}


def get_profile(name: str) -> Profile:
    """The profile called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown simulation profile {name!r}; known: {', '.join(PROFILES)}"
        ) from None
