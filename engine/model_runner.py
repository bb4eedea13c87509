"""Runs a transformers causal LM over the paged KV cache.

The model is loaded through ``AutoModelForCausalLM`` exactly as a user's local checkpoint is,
with ``attn_implementation="dpmesh_paged"``: an attention function registered in transformers'
``AttentionInterface``. Every decoder layer still does its own projections, RoPE, MLP and norms;
only attention is ours. It writes the step's new keys and values into the paged pool and attends
each query to its sequence's cached blocks, so a cached prefix is never recomputed: the forward
pass covers just the uncached tokens of every scheduled sequence, packed into one row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM

from engine.config import EngineConfig
from engine.sampler import sample
from engine.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "dpmesh_paged"


@dataclass
class PrefillSegment:
    q_start: int  # offset of this sequence's queries in the packed row
    q_len: int
    ctx_slots: torch.Tensor  # KV slots of positions [0, start + q_len)
    mask: torch.Tensor | None  # [q_len, ctx] bool; None means plain causal (nothing cached)


@dataclass
class PagedContext:
    """Per-step attention metadata, built once and read by every layer."""

    kv: torch.Tensor  # [2, layers, slots, kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [T] slot of each new token
    prefills: list[PrefillSegment]
    decode_index: torch.Tensor | None  # [B] query positions of single-token decodes
    decode_slots: torch.Tensor | None  # [B, max_ctx]
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_ctx] bool, or None when all lengths match


def paged_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    paged: PagedContext | None = None,
    **kwargs,
):
    """transformers attention function over the paged pool. ``query`` is [1, H, T, D] for the
    packed step; returns [1, T, H, D] as transformers expects."""
    if paged is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the engine's step context")
    k_cache, v_cache = paged.kv[0, module.layer_idx], paged.kv[1, module.layer_idx]
    # Write every new token first: a sequence admitted in this step may read blocks that another
    # sequence of the same step is computing (the scheduler published them already).
    k_cache[paged.slot_mapping] = key[0].transpose(0, 1)
    v_cache[paged.slot_mapping] = value[0].transpose(0, 1)
    q = query[0]  # [H, T, D]
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, H, D]
    for seg in paged.prefills:
        k = k_cache[seg.ctx_slots].transpose(0, 1).unsqueeze(0)
        v = v_cache[seg.ctx_slots].transpose(0, 1).unsqueeze(0)
        qs = q[:, seg.q_start : seg.q_start + seg.q_len].unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs,
            k,
            v,
            attn_mask=seg.mask,
            is_causal=seg.mask is None and seg.q_len > 1,
            scale=scaling,
            enable_gqa=True,
        )
        out[seg.q_start : seg.q_start + seg.q_len] = o[0].transpose(0, 1)
    if paged.decode_index is not None:
        k = k_cache[paged.decode_slots].transpose(1, 2)  # [B, KVH, ctx, D]
        v = v_cache[paged.decode_slots].transpose(1, 2)
        qd = q[:, paged.decode_index].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(
            qd, k, v, attn_mask=paged.decode_mask, scale=scaling, enable_gqa=True
        )
        out[paged.decode_index] = o[:, :, 0]
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


class ModelRunner:
    """Owns the model and the KV pool of one engine; turns a scheduled batch into sampled tokens."""

    def __init__(self, config: EngineConfig, model_path: str):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.block_size = config.block_size
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                model_path, dtype=self.dtype, attn_implementation=ATTN_IMPLEMENTATION
            )
            .to(self.device)
            .eval()
        )
        mc = self.model.config
        self.num_layers = mc.num_hidden_layers
        self.num_kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
        self.head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        self.num_kv_blocks = config.num_kv_blocks or max(
            1, (config.kv_cache_memory or config.DEFAULT_KV_MEMORY) // self.bytes_per_block
        )
        shape = (
            2,
            self.num_layers,
            self.num_kv_blocks * self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)
        logger.info(
            "KV pool: %d blocks x %d tokens, %.1f MiB",
            self.num_kv_blocks,
            self.block_size,
            self.kv_bytes / 2**20,
        )

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return getattr(self.model.config, "max_position_embeddings", None) or 2048

    def end_step(self, started: float) -> None:
        """The engine's end-of-step hook; a real forward pass has already taken its time (the
        simulated runner sleeps here until its modeled end)."""

    @property
    def bytes_per_block(self) -> int:
        item = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * item

    @property
    def kv_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _context(self, batch: ScheduledBatch) -> PagedContext:
        slot_mapping: list[int] = []
        prefills: list[PrefillSegment] = []
        decode_pos: list[int] = []
        decode_ctx: list[list[int]] = []
        for item in batch.items:
            seq, end = item.seq, item.start + item.num_tokens
            q_start = len(slot_mapping)
            slot_mapping += self._slots(seq.block_table, item.start, end)
            ctx_slots = self._slots(seq.block_table, 0, end)
            if item.num_tokens == 1:
                decode_pos.append(q_start)
                decode_ctx.append(ctx_slots)
                continue
            mask = None
            # queries see the whole cached prefix plus a causal window of their own
            if item.start > 0:
                q_pos = torch.arange(item.start, end, device=self.device).unsqueeze(1)
                mask = torch.arange(end, device=self.device).unsqueeze(0) <= q_pos
            prefills.append(
                PrefillSegment(
                    q_start, item.num_tokens, torch.tensor(ctx_slots, device=self.device), mask
                )
            )
        decode_index = decode_slots = decode_mask = None
        if decode_pos:
            width = max(len(c) for c in decode_ctx)
            decode_index = torch.tensor(decode_pos, device=self.device)
            decode_slots = torch.tensor(
                [c + [0] * (width - len(c)) for c in decode_ctx], device=self.device
            )
            if any(len(c) != width for c in decode_ctx):
                lengths = torch.tensor([len(c) for c in decode_ctx], device=self.device).unsqueeze(
                    1
                )
                decode_mask = (torch.arange(width, device=self.device).unsqueeze(0) < lengths)[
                    :, None, None, :
                ]
        return PagedContext(
            self.kv,
            torch.tensor(slot_mapping, device=self.device),
            prefills,
            decode_index,
            decode_slots,
            decode_mask,
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """One forward pass over the batch; returns one sampled token per sampling item, in
        order."""
        input_ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        for item in batch.items:
            end = item.start + item.num_tokens
            input_ids += item.seq.token_ids[item.start : end]
            positions += range(item.start, end)
            if item.samples:
                last.append(len(input_ids) - 1)
        paged = self._context(batch)
        keep = torch.tensor(last if last else [len(input_ids) - 1], device=self.device)
        out = self.model(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            use_cache=False,
            logits_to_keep=keep,
            paged=paged,
        )
        if not last:
            return []
        logits = out.logits[0].float()
        seqs = [item.seq for item in batch.items if item.samples]
        return sample(logits, seqs, self.generator)
