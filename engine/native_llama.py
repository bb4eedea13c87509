"""A native forward pass for Llama-architecture models, over the engine's paged KV cache.

transformers' ``LlamaForCausalLM`` runs every decoder layer as a tree of small modules: RMSNorm
is eight ops, q, k, v, gate and up are five matmuls, RoPE is a dozen ops over q and k apart, and
every module call pays hooks and keyword plumbing. On the CPU that per-op overhead is a good part
of a small model's decode step (11-21 % of the tiny model's: docs/benchmarks.md; issue 13, where
vLLM's CPU path runs fused kernels). ``NativeLlama`` computes the same function with the loaded
model's own weights in about fifteen ops a layer:

* one q|k|v matmul and one gate|up matmul: the fused weights are ``torch.cat`` of the separate
  ones, and the transformers modules' weights are then replaced by row views into them, so the
  weights are held once and the transformers path (``model_impl="transformers"``) still works;
* RoPE from cos/sin tables over every position, indexed once per step and shared by all layers,
  applied in place to the q and k heads of the fused output together;
* attention through ``engine.paged_attention.attend`` (the paged pool, prefix blocks, decodes by
  the cpp kernel or cascade groups), the function transformers' attention interface calls for
  the fallback path;
* in-place residual adds, and the final norm and ``lm_head`` only on the rows that sample;
* LoRA adapters (``engine.lora_layers``): a step whose sequences use some gets a ``LoRABatch``
  that adds each adapter's low-rank delta to its rows of every fused projection's output; a
  step without one runs the base path untouched.

Numerics follow transformers op for op where a rounding could differ: RMSNorm normalises in
float32, casts to the model's dtype and only then multiplies by its weight (``F.rms_norm``
without a weight does the first two bit for bit); RoPE is ``x * cos + rotate_half(x) * sin``
with each product rounded to the model's dtype (the sign of ``rotate_half`` is folded into the
sin table, which is exact); SiLU and the gate product round apart. A fused matmul's output rows
are the separate ones' dot products, so on this project's CPUs the logits equal the transformers
path's bit for bit, in float32 and bfloat16 (tests/engine/test_native_llama.py).

``unsupported_reason`` says which models qualify: ``LlamaForCausalLM``, ``MistralForCausalLM``
and ``Qwen2ForCausalLM`` (its q/k/v biases are fused like the weights) without a sliding window,
with SiLU, no other biases and default RoPE. Anything else runs through transformers.

Arrows: ``engine.model_runner`` imports this module; it imports ``engine.paged_attention`` and
``engine.paged_context`` (the attention both forward passes share) and ``engine.lora_layers``,
never the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora_layers import LoRABatch
from engine.paged_attention import attend
from engine.paged_context import PagedContext


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot take the native path; None when it can."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM
    from transformers.models.mistral.modeling_mistral import MistralForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

    c = model.config
    if type(model) not in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM):
        return f"{type(model).__name__} is not a Llama, Mistral or Qwen2 causal LM"
    if getattr(c, "sliding_window", None) is not None:
        return f"sliding window {c.sliding_window}"
    if c.hidden_act != "silu":
        return f"hidden_act {c.hidden_act!r}"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_biases = {lin.bias is None for lin in (attn.q_proj, attn.k_proj, attn.v_proj)}
        others = (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if len(qkv_biases) > 1 or any(lin.bias is not None for lin in others):
            return "biases other than on all of q, k and v"
    if getattr(c, "pretraining_tp", 1) != 1:
        return f"pretraining_tp {c.pretraining_tp}"
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope_type {rope['rope_type']!r}"
    return None


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 * KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


def _fuse(linears: list[nn.Linear], name: str = "weight") -> torch.Tensor:
    """The linears' weights (or biases) stacked by rows; each linear's becomes a view of its
    rows."""
    fused = torch.cat([getattr(lin, name) for lin in linears])
    row = 0
    for lin in linears:
        n = getattr(lin, name).shape[0]
        setattr(lin, name, nn.Parameter(fused[row : row + n], requires_grad=False))
        row += n
    return fused


class NativeLlama:
    """The decoder of a loaded Llama-architecture transformers model, one call per step."""

    @torch.no_grad()
    def __init__(self, model):
        c = model.config
        inner = model.model
        attn = inner.layers[0].self_attn
        self.heads = c.num_attention_heads
        self.kv_heads = c.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.eps = inner.norm.variance_epsilon
        self.intermediate = c.intermediate_size
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = []
        for layer in inner.layers[: c.num_hidden_layers]:
            qkv = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
            bias = None if qkv[0].bias is None else _fuse(qkv, "bias")
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight,
                    _fuse(qkv),
                    bias,
                    layer.self_attn.o_proj.weight,
                    layer.post_attention_layernorm.weight,
                    _fuse([layer.mlp.gate_proj, layer.mlp.up_proj]),
                    layer.mlp.down_proj.weight,
                )
            )
        # transformers' default RoPE: cos/sin of position * inv_freq in float32, then cast
        rotary = inner.rotary_emb
        positions = torch.arange(c.max_position_embeddings, device=self.embed.device)
        freqs = positions[:, None].float() * rotary.inv_freq.float().to(self.embed.device)
        self.cos = torch.cat((freqs, freqs), dim=-1).cos().to(self.embed.dtype)
        sin = freqs.sin()
        # rotate_half(x) * sin == flip_halves(x) * [-sin, sin]: the sign moved is exact
        self.sin = torch.cat((-sin, sin), dim=-1).to(self.embed.dtype)
        # float32 RMSNorm with its weight is the same bits in one op; in lower precision
        # transformers rounds before the weight multiply, so that stays a second op
        self.fused_norm_weight = self.embed.dtype == torch.float32

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused_norm_weight:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        return F.rms_norm(x, weight.shape, eps=self.eps).mul_(weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        keep: torch.Tensor,
        paged: PagedContext,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Logits [len(keep), vocab] for the packed step ``input_ids`` [T] at ``positions``;
        ``lora``: the step's adapters and their rows (engine/lora_layers.py), added to each
        projection's output (None: the base model alone)."""
        tokens = input_ids.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        rotated = heads + kv_heads  # q and k heads, adjacent in the fused output
        cos = self.cos.index_select(0, positions)[:, None]  # [T, 1, D]
        sin = self.sin.index_select(0, positions).view(tokens, 1, 2, dim // 2)
        h = F.embedding(input_ids, self.embed)  # [T, hidden]; ours, so updated in place
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.input_norm)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            if lora is not None:
                lora.add(i, "qkv", x, qkv)
            qkv = qkv.view(tokens, heads + 2 * kv_heads, dim)
            qk = qkv[:, :rotated]
            flipped = qk.unflatten(-1, (2, dim // 2)).flip(-2).mul_(sin)
            qk.mul_(cos).add_(flipped.view(tokens, rotated, dim))
            out = attend(
                i,
                qkv[:, :heads].transpose(0, 1),
                qkv[:, heads:rotated].transpose(0, 1),
                qkv[:, rotated:].transpose(0, 1),
                paged,
                self.scaling,
            ).view(tokens, -1)
            h += self._project(i, "o", out, layer.o, lora)
            x = self._rms_norm(h, layer.post_norm)
            gate_up = self._project(i, "gate_up", x, layer.gate_up, lora)
            act = F.silu(gate_up[:, : self.intermediate]).mul_(gate_up[:, self.intermediate :])
            h += self._project(i, "down", act, layer.down, lora)
        return F.linear(self._rms_norm(h.index_select(0, keep), self.norm), self.lm_head)

    @staticmethod
    def _project(
        i: int, name: str, x: torch.Tensor, weight: torch.Tensor, lora: LoRABatch | None
    ) -> torch.Tensor:
        """``x @ weight.T``, plus the step's adapters' deltas on their rows."""
        out = F.linear(x, weight)
        if lora is not None:
            lora.add(i, name, x, out)
        return out
