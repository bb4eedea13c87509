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
    ctx_len: int  # start + q_len: the keys this segment attends to
    blocks: torch.Tensor | None  # block ids covering [0, ctx_len); None: nothing cached, use the
    # step's own keys
    mask: torch.Tensor | None  # [q_len, ctx] bool; None means plain causal (nothing cached)


@dataclass
class PagedContext:
    """Per-step attention metadata, built once and read by every layer."""

    kv: torch.Tensor  # [2, layers, blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [T] slot (block * block_size + offset) of each new token
    prefills: list[PrefillSegment]
    decode_index: torch.Tensor | slice | None  # query positions of single-token decodes
    decode_blocks: torch.Tensor | None  # [B * max_blocks] block ids, row-major, zero-padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool, or None
    decode_batch: int = 0  # B


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
    k_blocks, v_blocks = paged.kv[0, module.layer_idx], paged.kv[1, module.layer_idx]
    kv_heads, head_dim = k_blocks.shape[-2:]
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, KVH, D]
    # Write every new token first: a sequence admitted in this step may read blocks that another
    # sequence of the same step is computing (the scheduler published them already).
    k_blocks.view(-1, kv_heads, head_dim).index_copy_(0, paged.slot_mapping, k_new)
    v_blocks.view(-1, kv_heads, head_dim).index_copy_(0, paged.slot_mapping, v_new)
    q = query[0]  # [H, T, D]
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, H, D]
    for seg in paged.prefills:
        qs = q[:, seg.q_start : seg.q_start + seg.q_len].unsqueeze(0)
        if seg.blocks is None:  # nothing cached: the keys are this step's own
            k = key[:, :, seg.q_start : seg.q_start + seg.q_len]
            v = value[:, :, seg.q_start : seg.q_start + seg.q_len]
        else:  # gather whole blocks (contiguous rows), then trim to the context
            k = k_blocks.index_select(0, seg.blocks).view(-1, kv_heads, head_dim)[: seg.ctx_len]
            v = v_blocks.index_select(0, seg.blocks).view(-1, kv_heads, head_dim)[: seg.ctx_len]
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
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
        # [B * W blocks] -> [B, W * block_size, KVH, D] -> [B, KVH, ctx, D]
        shape = (paged.decode_batch, -1, kv_heads, head_dim)
        k = k_blocks.index_select(0, paged.decode_blocks).view(shape).transpose(1, 2)
        v = v_blocks.index_select(0, paged.decode_blocks).view(shape).transpose(1, 2)
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
        self.block_size = config.block_size
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                model_path,
                dtype="auto" if config.dtype == "auto" else getattr(torch, config.dtype),
                attn_implementation=ATTN_IMPLEMENTATION,
            )
            .to(self.device)
            .eval()
        )
        self.dtype = self.model.dtype  # "auto" resolved: the checkpoint's own dtype
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
            self.num_kv_blocks,
            self.block_size,
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

    def _context(self, batch: ScheduledBatch) -> PagedContext:
        bs = self.block_size
        slot_mapping: list[int] = []
        prefills: list[PrefillSegment] = []
        decode_pos: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for item in batch.items:
            table, start, end = item.seq.block_table, item.start, item.start + item.num_tokens
            q_start = len(slot_mapping)
            if item.num_tokens == 1:
                slot_mapping.append(table[start // bs] * bs + start % bs)
                decode_pos.append(q_start)
                decode_tables.append(table[: (end + bs - 1) // bs])
                decode_lens.append(end)
                continue
            for b in range(start // bs, (end + bs - 1) // bs):
                base = table[b] * bs
                slot_mapping.extend(
                    range(base + max(start - b * bs, 0), base + min(end - b * bs, bs))
                )
            mask = blocks = None
            # queries see the whole cached prefix plus a causal window of their own
            if start > 0:
                q_pos = torch.arange(start, end, device=self.device).unsqueeze(1)
                mask = torch.arange(end, device=self.device).unsqueeze(0) <= q_pos
                blocks = torch.tensor(table[: (end + bs - 1) // bs], device=self.device)
            prefills.append(PrefillSegment(q_start, item.num_tokens, end, blocks, mask))
        decode_index = decode_blocks = decode_mask = None
        if decode_pos:
            width = max(len(t) for t in decode_tables)
            n = len(decode_pos)
            first = decode_pos[0]
            contiguous = decode_pos[-1] - first == n - 1
            decode_index = (
                slice(first, first + n)
                if contiguous
                else torch.tensor(decode_pos, device=self.device)
            )
            decode_blocks = torch.tensor(
                [b for t in decode_tables for b in (t + [0] * (width - len(t)))],
                device=self.device,
            )
            if any(length != width * bs for length in decode_lens):
                lengths = torch.tensor(decode_lens, device=self.device).unsqueeze(1)
                decode_mask = (torch.arange(width * bs, device=self.device) < lengths)[
                    :, None, None, :
                ]
        return PagedContext(
            self.kv,
            torch.tensor(slot_mapping, device=self.device),
            prefills,
            decode_index,
            decode_blocks,
            decode_mask,
            len(decode_pos),
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
