"""Attention over the paged KV pool: the function every layer calls, on either forward pass.

``attend`` writes the step's new keys and values into the pool and attends each query to its
sequence's cached blocks, so a cached prefix is never recomputed. transformers' decoder layers
reach it through ``paged_attention``, registered in transformers' ``AttentionInterface`` as
``ATTN_IMPLEMENTATION`` (the model is loaded with ``attn_implementation`` set to it);
``engine.native_llama`` calls ``attend`` directly.

Decodes take one of three paths, as the step's ``PagedContext`` says: the cpp kernel
(``engine.paged_kernel``: every row's blocks read in place, no gather), cascade groups on the
CPU (each group's queries meet its shared blocks in one kernel call, each sequence's own blocks
in the batch's call, and the two partial results are merged by their log-sum-exps), or SDPA
over gathered tables.

Arrows: ``engine.model_runner`` imports this module (importing it registers
``paged_attention`` with transformers) and ``engine.native_llama`` imports ``attend``; this
module imports only ``engine.paged_context``, the data it reads, never the runner.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine.paged_context import PagedContext

ATTN_IMPLEMENTATION = "dpmesh_paged"
_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, logsumexp)


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
    packed step; returns [1, T, H, D] as transformers expects. Without a step context (a plain
    forward pass, as ``ModelRunner.embed`` makes: no pool, nothing kept) transformers' own SDPA
    attention over the given keys."""
    if paged is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
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


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
