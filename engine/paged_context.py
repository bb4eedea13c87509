"""What one step's attention reads, and how it is built from the scheduled batch.

The forward pass covers just the uncached tokens of every scheduled sequence, packed into one
row. ``build_context`` turns the batch's block tables into the metadata every layer's attention
reads (``PagedContext``): the pool slot of each new token, one segment per prefill, and the
decodes' block tables in the form the chosen decode path takes.

Decodes that share a cached prefix (the same leading block ids: a system prompt, a few-shot
preamble) attend to it once, together (cascade attention): on the CPU each group's queries meet
its shared blocks in one kernel call, each sequence's own blocks in the batch's call
(``engine.paged_attention``). ``cascade_groups`` finds those groups; the shared blocks are then
gathered once per group instead of once per member (``CASCADE_MIN_BLOCKS``). With the cpp decode
kernel (``engine.paged_kernel``) there is no grouping: it reads each row's blocks where they
lie, from per-row block tables and lengths built here once per step.

Arrows: ``engine.model_runner`` builds the context here; ``engine.paged_attention`` and
``engine.native_llama`` read it. This module imports neither of them, nor the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.scheduler import ScheduledBatch

# Decodes whose block tables start with the same this-many blocks or more (and at least two of
# them) attend to those blocks as one group. Below it the extra kernel calls cost more than the
# gather they save.
CASCADE_MIN_BLOCKS = 4


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

    kv: torch.Tensor  # [2, layers, kv_heads, blocks, block_size, head_dim]: head-major (see
    # ``engine.paged_attention._decode_keys``)
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


@dataclass
class _Decodes:
    """The step's single-token decodes as plain lists, while the context is being built."""

    positions: list[int] = field(default_factory=list)  # query positions in the packed row
    tables: list[list[int]] = field(default_factory=list)  # block ids covering each context
    lengths: list[int] = field(default_factory=list)  # context lengths, the new token included


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


def build_context(
    batch: ScheduledBatch,
    kv: torch.Tensor,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    decode_kernel: Callable | None = None,
) -> tuple[PagedContext, bool]:
    """The step's ``PagedContext`` over the pool ``kv``, and whether its decodes read a shared
    prefix (in a cascade group, or in place by the kernel): the runner counts those steps.

    The decodes take ``decode_kernel`` when given, else cascade groups on the CPU, else SDPA
    over gathered tables (other devices)."""
    slots, prefills, decodes = _split_items(batch, block_size, device)
    paged = PagedContext(kv, torch.tensor(slots, device=device), prefills, None, None, None)
    if not decodes.positions:
        return paged, False
    paged.decode_batch = len(decodes.positions)
    paged.decode_index = _decode_index(decodes.positions, device)
    if decode_kernel is not None:
        _add_kernel_tables(paged, decodes, decode_kernel)
        first_blocks = {t[0] for t in decodes.tables}
        return paged, len(first_blocks) < len(decodes.tables)  # rows reading one prefix
    shared = device.type == "cpu" and _add_cascade(paged, decodes, block_size, device)
    _add_gathered_tables(paged, decodes, block_size, device, dtype)
    return paged, shared


def _split_items(batch: ScheduledBatch, block_size: int, device: torch.device):
    """(slot of every new token, one segment per prefill, the decodes), in packed-row order."""
    bs = block_size
    slots: list[int] = []
    prefills: list[PrefillSegment] = []
    decodes = _Decodes()
    for item in batch.items:
        table, start, end = item.seq.block_table, item.start, item.start + item.num_tokens
        q_start = len(slots)
        if item.num_tokens == 1:
            slots.append(table[start // bs] * bs + start % bs)
            decodes.positions.append(q_start)
            decodes.tables.append(table[: (end + bs - 1) // bs])
            decodes.lengths.append(end)
            continue
        for b in range(start // bs, (end + bs - 1) // bs):
            base = table[b] * bs
            slots.extend(range(base + max(start - b * bs, 0), base + min(end - b * bs, bs)))
        prefills.append(_prefill_segment(table, start, end, q_start, bs, device))
    return slots, prefills, decodes


def _prefill_segment(table, start: int, end: int, q_start: int, bs: int, device) -> PrefillSegment:
    """A prefill of tokens [start, end): queries see the whole cached prefix plus a causal window
    of their own; with nothing cached, plain causal attention over the step's own keys."""
    mask = blocks = None
    if start > 0:
        q_pos = torch.arange(start, end, device=device).unsqueeze(1)
        mask = torch.arange(end, device=device).unsqueeze(0) <= q_pos
        blocks = torch.tensor(table[: (end + bs - 1) // bs], device=device)
    return PrefillSegment(q_start, end - start, end, blocks, mask)


def _decode_index(positions: list[int], device) -> torch.Tensor | slice:
    """The decodes' query positions: a slice when they are adjacent (a view, no index)."""
    first, n = positions[0], len(positions)
    if positions[-1] - first == n - 1:
        return slice(first, first + n)
    return torch.tensor(positions, device=device)


def _add_kernel_tables(paged: PagedContext, decodes: _Decodes, kernel: Callable) -> None:
    """The cpp kernel's inputs: zero-padded int32 block tables and context lengths."""
    width = max(len(t) for t in decodes.tables)
    paged.decode_kernel = kernel
    paged.decode_tables = torch.tensor(
        [t + [0] * (width - len(t)) for t in decodes.tables], dtype=torch.int32
    )
    paged.decode_lens = torch.tensor(decodes.lengths, dtype=torch.int32)


def _add_cascade(paged: PagedContext, decodes: _Decodes, bs: int, device) -> bool:
    """Group the decodes by shared leading blocks (``cascade_groups``) and cut each member's
    table and length to its own part; True when there is a group. With none ``cascade`` is
    still a list: the CPU decode path takes log-sum-exps either way."""
    paged.cascade = []
    n = len(decodes.positions)
    groups = cascade_groups(decodes.tables, decodes.lengths, bs) if n > 1 else []
    if not groups:
        return False
    place = [0] * n  # each row's index among the groups' members
    grouped = 0
    for rows, shared in groups:
        paged.cascade.append(_cascade_group(decodes, rows, shared, device))
        for r in rows:
            decodes.tables[r] = decodes.tables[r][shared:]
            decodes.lengths[r] -= shared * bs
            place[r] = grouped
            grouped += 1
    paged.cascade_rows = torch.tensor(place, device=device)
    if grouped < n:
        in_group = {r for rows, _ in groups for r in rows}
        bias = [0.0 if r in in_group else float("-inf") for r in range(n)]
        paged.cascade_lse_bias = torch.tensor(bias, device=device).view(-1, 1, 1)
    return True


def _cascade_group(decodes: _Decodes, rows: list[int], shared: int, device) -> CascadeGroup:
    """The group of ``rows`` over their first ``shared`` blocks, read as a slice of the pool
    when those block ids are consecutive."""
    blocks = decodes.tables[rows[0]][:shared]
    first = blocks[0]
    consecutive = blocks[-1] - first == shared - 1 and all(
        b == first + i for i, b in enumerate(blocks)
    )
    return CascadeGroup(
        torch.tensor(rows, device=device),
        torch.tensor(blocks, device=device),
        torch.tensor([decodes.positions[r] for r in rows], device=device),
        slice(first, first + shared) if consecutive else None,
    )


def _add_gathered_tables(paged: PagedContext, decodes: _Decodes, bs: int, device, dtype) -> None:
    """The torch decode path's inputs: all rows' block ids, zero-padded to the widest table,
    and a mask over the padding when some row does not fill its blocks (additive with
    ``cascade``: the kernel that returns log-sum-exps takes no bool mask)."""
    width = max(len(t) for t in decodes.tables)
    paged.decode_blocks = torch.tensor(
        [b for t in decodes.tables for b in (t + [0] * (width - len(t)))], device=device
    )
    if all(length == width * bs for length in decodes.lengths):
        return
    lengths = torch.tensor(decodes.lengths, device=device).unsqueeze(1)
    mask = (torch.arange(width * bs, device=device) < lengths)[:, None, None, :]
    if paged.cascade is not None:
        additive = torch.zeros(mask.shape, dtype=dtype, device=device)
        mask = additive.masked_fill_(~mask, float("-inf"))
    paged.decode_mask = mask
