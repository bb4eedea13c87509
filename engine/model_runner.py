"""Runs a transformers causal LM over the paged KV cache.

The model is loaded through ``AutoModelForCausalLM`` exactly as a user's local checkpoint is,
with ``attn_implementation="dpmesh_paged"``: an attention function registered in transformers'
``AttentionInterface``. A Llama-architecture model then runs through ``engine.native_llama``
(``EngineConfig.model_impl``): the same function with fused projections and far fewer ops;
anything else runs through transformers' decoder layers, with only attention ours. Either way
``attend`` writes the step's new keys and values into the paged pool and attends each query to
its sequence's cached blocks, so a cached prefix is never recomputed: the forward pass covers
just the uncached tokens of every scheduled sequence, packed into one row.

Decodes that share a cached prefix (the same leading block ids: a system prompt, a few-shot
preamble) attend to it once, together (cascade attention): on the CPU each group's queries meet
its shared blocks in one kernel call, each sequence's own blocks in the batch's call, and the two
partial results are merged by their log-sum-exps. The shared blocks are gathered once per group
instead of once per member (``CASCADE_MIN_BLOCKS``).

With ``attention_impl="cpp"`` (``EngineConfig``; ``auto`` picks it when it compiles) the decodes
take ``engine.paged_kernel`` instead: a C++ kernel that reads every row's blocks where they lie
in the pool, so there is neither a gather nor a cascade grouping (a shared prefix is read in
place by each row); its per-row block tables and lengths are built once per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM

from engine import paged_kernel
from engine.config import EngineConfig
from engine.sampler import sample
from engine.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "dpmesh_paged"
# Decodes whose block tables start with the same this-many blocks or more (and at least two of
# them) attend to those blocks as one group. Below it the extra kernel calls cost more than the
# gather they save.
CASCADE_MIN_BLOCKS = 4
_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, logsumexp)


@dataclass
class PrefillSegment:
    q_start: int  # offset of this sequence's queries in the packed row
    q_len: int
    ctx_len: int  # start + q_len: the keys this segment attends to
    blocks: torch.Tensor | None  # block ids covering [0, ctx_len); None: nothing cached, use the
    # step's own keys
    mask: torch.Tensor | None  # [q_len, ctx] bool; None means plain causal (nothing cached)


@dataclass
class CascadeGroup:
    """Decode rows (their order among the step's decodes) whose tables share ``blocks``."""

    members: torch.Tensor  # [n] decode row indices
    blocks: torch.Tensor  # [P] the shared leading block ids
    positions: torch.Tensor | None = None  # [n] the members' query positions in the packed row
    block_slice: slice | None = None  # ``blocks`` as a slice when they are consecutive ids (a
    # prefix allocated in one go): the pool's view, no gather


@dataclass
class PagedContext:
    """Per-step attention metadata, built once and read by every layer."""

    kv: torch.Tensor  # [2, layers, kv_heads, blocks, block_size, head_dim]: head-major (below)
    slot_mapping: torch.Tensor  # [T] slot (block * block_size + offset) of each new token
    prefills: list[PrefillSegment]
    decode_index: torch.Tensor | slice | None  # query positions of single-token decodes
    decode_blocks: torch.Tensor | None  # [B * max_blocks] block ids, row-major, zero-padded
    # (with ``cascade``: each row's blocks after its group's shared ones)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool (with
    # ``cascade``: additive, in the model's dtype), or None: every row fills its blocks
    decode_batch: int = 0  # B
    # shared-prefix groups of the decodes (maybe none) on the CPU; None elsewhere (the kernel
    # that returns log-sum-exps is the CPU's: other devices take SDPA over whole tables)
    cascade: list[CascadeGroup] | None = None
    # with groups: each decode row's place among the groups' members, concatenated in group
    # order ([B]; an ungrouped row any place), and the log-sum-exp bias that drops the shared
    # part of ungrouped rows ([B, 1, 1]: -inf there, 0 elsewhere; None when every row is grouped)
    cascade_rows: torch.Tensor | None = None
    cascade_lse_bias: torch.Tensor | None = None
    # the cpp decode kernel (``engine.paged_kernel``) and its inputs: each decode row's block
    # ids (int32 [B, W], zero-padded) and context length (int32 [B]); then ``decode_blocks``,
    # ``decode_mask`` and ``cascade`` are None
    decode_kernel: Callable | None = None
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None


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
    return attend(module.layer_idx, query[0], key[0], value[0], paged, scaling).unsqueeze(0), None


def attend(layer: int, q, key, value, paged: PagedContext, scaling) -> torch.Tensor:
    """Layer ``layer``'s attention for the packed step: writes the new ``key`` / ``value``
    [KVH, T, D] into the pool, attends the queries ``q`` [H, T, D] (any strides) and returns
    [T, H, D]."""
    k_blocks, v_blocks = paged.kv[0, layer], paged.kv[1, layer]
    kv_heads, _, _, head_dim = k_blocks.shape  # [KVH, blocks, block_size, D]
    # Write every new token first: a sequence admitted in this step may read blocks that another
    # sequence of the same step is computing (the scheduler published them already).
    k_blocks.view(kv_heads, -1, head_dim).index_copy_(1, paged.slot_mapping, key)
    v_blocks.view(kv_heads, -1, head_dim).index_copy_(1, paged.slot_mapping, value)
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, H, D]
    for seg in paged.prefills:
        qs = q[:, seg.q_start : seg.q_start + seg.q_len].unsqueeze(0)
        if seg.blocks is None:  # nothing cached: the keys are this step's own
            k = key[None, :, seg.q_start : seg.q_start + seg.q_len]
            v = value[None, :, seg.q_start : seg.q_start + seg.q_len]
        else:  # gather whole blocks (per head, contiguous rows), then trim to the context
            k = k_blocks.index_select(1, seg.blocks).view(kv_heads, -1, head_dim)
            v = v_blocks.index_select(1, seg.blocks).view(kv_heads, -1, head_dim)
            k, v = k[None, :, : seg.ctx_len], v[None, :, : seg.ctx_len]
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
    if paged.decode_index is not None and paged.decode_kernel is not None:
        qd = q[:, paged.decode_index].transpose(0, 1)  # [B, H, D], a view
        scale = head_dim**-0.5 if scaling is None else scaling
        args = (qd, k_blocks, v_blocks, paged.decode_tables, paged.decode_lens, scale)
        if isinstance(paged.decode_index, slice):  # written in place
            paged.decode_kernel(*args, out[paged.decode_index])
        else:
            out[paged.decode_index] = paged.decode_kernel(*args, None)
    elif paged.decode_index is not None and paged.cascade is not None:
        out[paged.decode_index] = _cascade_decode(q, k_blocks, v_blocks, paged, scaling)
    elif paged.decode_index is not None:
        k, v = _decode_keys(k_blocks, v_blocks, paged)
        qd = q[:, paged.decode_index].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(
            qd, k, v, attn_mask=paged.decode_mask, scale=scaling, enable_gqa=True
        )
        out[paged.decode_index] = o[:, :, 0]
    return out


def _decode_keys(k_blocks, v_blocks, paged: PagedContext):
    """The decodes' keys and values, [B, KVH, ctx, D]: [KVH, B * W blocks, block_size, D] viewed
    as [KVH, B, W * block_size, D], so each (sequence, head)'s keys are one contiguous [ctx, D]
    slab, as the attention kernel reads them (the pool's head-major layout is for this;
    token-major, the same gather took 2.5x as long and left the kernel strided rows)."""
    kv_heads, _, _, head_dim = k_blocks.shape
    shape = (kv_heads, paged.decode_batch, -1, head_dim)
    k = k_blocks.index_select(1, paged.decode_blocks).view(shape).transpose(0, 1)
    v = v_blocks.index_select(1, paged.decode_blocks).view(shape).transpose(0, 1)
    return k, v


def _cascade_decode(q, k_blocks, v_blocks, paged: PagedContext, scaling) -> torch.Tensor:
    """Single-token decodes with shared-prefix groups; returns [B, H, D]. Query heads are folded
    into the query length per KV head ([B, KVH, H / KVH, D]: one token's heads that read the same
    keys), so GQA needs no copy of the keys; head h reads KV head h // (H / KVH), as
    transformers' ``repeat_kv`` has it."""
    kv_heads, _, _, head_dim = k_blocks.shape
    batch = paged.decode_batch
    heads = q.shape[0]
    group = heads // kv_heads
    qd = q[:, paged.decode_index].transpose(0, 1).reshape(batch, kv_heads, group, head_dim)
    k, v = _decode_keys(k_blocks, v_blocks, paged)
    out, lse = _flash_with_lse(qd, k, v, attn_mask=paged.decode_mask, scale=scaling)[:2]
    if not paged.cascade:
        return out.reshape(batch, heads, head_dim)
    shared_outs, shared_lses = [], []
    qh = q.unflatten(0, (kv_heads, group))  # [KVH, H / KVH, T, D], a view
    for cg in paged.cascade:
        if cg.block_slice is not None:
            ks = k_blocks[:, cg.block_slice].reshape(1, kv_heads, -1, head_dim)  # a view
            vs = v_blocks[:, cg.block_slice].reshape(1, kv_heads, -1, head_dim)
        else:
            ks = k_blocks.index_select(1, cg.blocks).view(1, kv_heads, -1, head_dim)
            vs = v_blocks.index_select(1, cg.blocks).view(1, kv_heads, -1, head_dim)
        # the members' queries as [1, KVH, (H / KVH) * n, D]: rows are independent, any order
        qg = qh.index_select(2, cg.positions).view(1, kv_heads, -1, head_dim)
        shared, shared_lse = _flash_with_lse(qg, ks, vs, scale=scaling)[:2]
        n = cg.positions.numel()
        shared_outs.append(shared.view(kv_heads, group, n, head_dim))
        shared_lses.append(shared_lse.view(kv_heads, group, n))
    # every group's part in one [KVH, H / KVH, M, D], then per decode row: [B, KVH, H / KVH, D]
    shared = torch.cat(shared_outs, 2) if len(shared_outs) > 1 else shared_outs[0]
    shared_lse = torch.cat(shared_lses, 2) if len(shared_lses) > 1 else shared_lses[0]
    shared = shared.index_select(2, paged.cascade_rows).permute(2, 0, 1, 3).float()
    shared_lse = shared_lse.index_select(2, paged.cascade_rows).permute(2, 0, 1)
    if paged.cascade_lse_bias is not None:  # ungrouped rows: weight 0, their own result as is
        shared_lse = shared_lse + paged.cascade_lse_bias
    own = out.float()
    top = torch.maximum(lse, shared_lse)
    w_own = torch.exp(lse - top).unsqueeze(-1)
    w_shared = torch.exp(shared_lse - top).unsqueeze(-1)
    merged = (own * w_own + shared * w_shared) / (w_own + w_shared)
    return merged.to(out.dtype, memory_format=torch.contiguous_format).view(batch, heads, head_dim)


def cascade_groups(tables: list[list[int]], lengths: list[int], block_size: int):
    """Group decode rows by the leading blocks their tables share: ``[(rows, shared block
    count)]`` for groups of two or more sharing at least ``CASCADE_MIN_BLOCKS`` blocks. A row's
    last block (the one its new token goes to) is never shared: the count stops before it."""
    by_first: dict[int, list[int]] = {}
    for row, table in enumerate(tables):
        by_first.setdefault(table[0], []).append(row)
    groups = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        limit = min((lengths[r] - 1) // block_size for r in rows)
        first = tables[rows[0]]
        shared = 0
        while shared < limit and all(tables[r][shared] == first[shared] for r in rows):
            shared += 1
        if shared >= CASCADE_MIN_BLOCKS:
            groups.append((rows, shared))
    return groups


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
        self.native = self._native_model(config.model_impl)
        self.model_impl = "transformers" if self.native is None else "native"
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
            self.num_kv_heads,
            self.num_kv_blocks,
            self.block_size,
            self.head_dim,
        )
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)
        # steps whose decodes attended to a shared prefix: as a group (torch), or in place by
        # each row (cpp: counted when two decode rows start at the same block)
        self.cascade_steps = 0
        self.decode_kernel = self._decode_kernel(config.attention_impl, mc)
        self.attention_impl = "torch" if self.decode_kernel is None else "cpp"
        logger.info(
            "KV pool: %d blocks x %d tokens, %.1f MiB",
            self.num_kv_blocks,
            self.block_size,
            self.kv_bytes / 2**20,
        )

    def _native_model(self, model_impl: str):
        """``engine.native_llama``'s forward pass for the model, or None for transformers'."""
        # imported here: native_llama calls this module's ``attend``
        from engine.native_llama import NativeLlama, unsupported_reason

        if model_impl == "transformers":
            return None
        reason = unsupported_reason(self.model)
        if reason is None:
            return NativeLlama(self.model)
        if model_impl == "native":
            raise ValueError(f"model_impl='native' cannot run this model: {reason}")
        logger.info("transformers forward pass: no native one for this model (%s)", reason)
        return None

    def _decode_kernel(self, attention_impl: str, mc):
        """``engine.paged_kernel``'s compiled decode function, or None for the torch path."""
        if attention_impl == "torch":
            return None
        heads = mc.num_attention_heads
        reason = None
        if self.device.type != "cpu":
            reason = f"device {self.device.type}"
        elif self.dtype not in paged_kernel.DTYPES:
            reason = f"dtype {self.dtype}"
        elif self.head_dim > 256 or heads % self.num_kv_heads or heads // self.num_kv_heads > 16:
            reason = f"{heads} heads, {self.num_kv_heads} KV heads, head_dim {self.head_dim}"
        elif paged_kernel.load() is None:
            reason = f"it did not build ({paged_kernel.error()})"
        if reason is None:
            logger.info("attention: cpp paged decode kernel (engine/paged_kernel.py)")
            return paged_kernel.load().paged_decode
        if attention_impl == "cpp":
            raise ValueError(f"attention_impl='cpp' cannot run here: {reason}")
        logger.info("attention: torch (no cpp paged decode kernel: %s)", reason)
        return None

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
        decode_index = decode_blocks = decode_mask = cascade = None
        cascade_rows = cascade_lse_bias = None
        # a runner without the attribute (a test's stand-in) takes the torch path
        kernel = getattr(self, "decode_kernel", None) if decode_pos else None
        if kernel is not None:
            first_blocks = {t[0] for t in decode_tables}
            if len(first_blocks) < len(decode_tables):  # rows reading one prefix, in place
                self.cascade_steps += 1
        elif decode_pos and self.device.type == "cpu":
            cascade = []
            groups = cascade_groups(decode_tables, decode_lens, bs) if len(decode_pos) > 1 else []
            if groups:
                self.cascade_steps += 1
                place = [0] * len(decode_pos)  # each row's index among the groups' members
                grouped = 0
                for rows, shared in groups:
                    blocks = decode_tables[rows[0]][:shared]
                    first_block = blocks[0]
                    consecutive = blocks[-1] - first_block == shared - 1 and all(
                        b == first_block + i for i, b in enumerate(blocks)
                    )
                    cascade.append(
                        CascadeGroup(
                            torch.tensor(rows, device=self.device),
                            torch.tensor(blocks, device=self.device),
                            torch.tensor([decode_pos[r] for r in rows], device=self.device),
                            slice(first_block, first_block + shared) if consecutive else None,
                        )
                    )
                    for r in rows:
                        decode_tables[r] = decode_tables[r][shared:]
                        decode_lens[r] -= shared * bs
                        place[r] = grouped
                        grouped += 1
                cascade_rows = torch.tensor(place, device=self.device)
                if grouped < len(decode_pos):
                    in_group = {r for rows, _ in groups for r in rows}
                    bias = [0.0 if r in in_group else float("-inf") for r in range(len(place))]
                    cascade_lse_bias = torch.tensor(bias, device=self.device).view(-1, 1, 1)
        decode_tables_t = decode_lens_t = None
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
        if kernel is not None:
            decode_tables_t = torch.tensor(
                [t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.int32
            )
            decode_lens_t = torch.tensor(decode_lens, dtype=torch.int32)
        elif decode_pos:
            decode_blocks = torch.tensor(
                [b for t in decode_tables for b in (t + [0] * (width - len(t)))],
                device=self.device,
            )
            if any(length != width * bs for length in decode_lens):
                lengths = torch.tensor(decode_lens, device=self.device).unsqueeze(1)
                decode_mask = (torch.arange(width * bs, device=self.device) < lengths)[
                    :, None, None, :
                ]
                if cascade is not None:  # the kernel with log-sum-exps takes additive masks
                    decode_mask = torch.zeros(
                        decode_mask.shape, dtype=self.dtype, device=self.device
                    ).masked_fill_(~decode_mask, float("-inf"))
        return PagedContext(
            self.kv,
            torch.tensor(slot_mapping, device=self.device),
            prefills,
            decode_index,
            decode_blocks,
            decode_mask,
            len(decode_pos),
            cascade,
            cascade_rows,
            cascade_lse_bias,
            kernel,
            decode_tables_t,
            decode_lens_t,
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
        ids = torch.tensor(input_ids, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        if self.native is not None:
            logits = self.native.forward(ids, pos, keep, paged)
        else:
            logits = self.model(
                input_ids=ids[None],
                position_ids=pos[None],
                use_cache=False,
                logits_to_keep=keep,
                paged=paged,
            ).logits[0]
        if not last:
            return []
        seqs = [item.seq for item in batch.items if item.samples]
        return sample(logits.float(), seqs, self.generator)
