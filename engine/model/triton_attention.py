"""Paged attention for short causal chains on a GPU (decoding, verifying chains of drafts): one Triton kernel reads
each row's keys and values where they lie in the pool, through its sequence's block table, so nothing is gathered.

A row is one new token: its query, its sequence's block table, the sequence's cached entries (all visible) and which
of the step's new entries it sees (`ancestors`, a bit each: a chain's rows up to itself, a tree node's path; tree
nodes' entries lie in list order after the cached ones, engine/model/forward.py). A layer's sliding window counts back
from the row's position over the cached entries (whose KV indices are their positions); the new entries a row sees
are within any window wider than MAX_PAGED_ROWS_QUERY_LEN, which the runner checks. One program per (row, KV head)
computes the rows of the query heads that share the KV head together, with an online softmax over tiles of keys, in
float32. Each row is computed
alone, whatever else is in the batch, so its output does not depend on the batch (and the kernel has fixed shapes
once the rows' count and the block tables' width are fixed: CUDA graphs capture it, engine/model/cuda_graphs.py).
Imported only where the runner attends on a GPU; `TRITON_INTERPRET=1` runs it on a CPU (tests/engine/model).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.attention_layout import PagedRows

KEYS_PER_TILE = 64
NO_WINDOW = 2**30  # the window of a layer without one: wider than any context


@triton.jit
def _paged_rows_kernel(
    query, keys, values, out, row_index, block_tables, num_cached, key_end, ancestors, positions, scale, window,
    stride_q_row, stride_q_head, stride_k_slot, stride_k_head, stride_o_row, stride_o_head, stride_table,
    heads_per_kv_head: tl.constexpr, head_dim: tl.constexpr, block_size: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    program, kv_head = tl.program_id(0), tl.program_id(1)
    row = tl.load(row_index + program)
    cached = tl.load(num_cached + program)
    count = tl.load(key_end + program)
    seen = tl.load(ancestors + program)
    start = tl.maximum(tl.load(positions + program) - window + 1, 0)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * heads_per_kv_head + g
    q_mask = (g[:, None] < heads_per_kv_head) & (d[None, :] < head_dim)
    q = tl.load(query + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :], mask=q_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    first = (start // BLOCK_N) * BLOCK_N
    for tile in range(first, count, BLOCK_N):
        index = tile + tl.arange(0, BLOCK_N)
        new_bit = (seen >> tl.maximum(index - cached, 0).to(tl.int64)) & 1
        valid = (index >= start) & (index < count) & ((index < cached) | (new_bit == 1))
        block = tl.load(block_tables + program * stride_table + index // block_size, mask=valid, other=0)
        slot = block.to(tl.int64) * block_size + index % block_size
        kv_mask = valid[:, None] & (d[None, :] < head_dim)
        k = tl.load(keys + slot[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(values + slot[:, None] * stride_k_slot + kv_head * stride_k_head + d[None, :], mask=kv_mask,
                    other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    result = acc / l_i[:, None]
    tl.store(out + row * stride_o_row + heads[:, None] * stride_o_head + d[None, :], result.to(out.dtype.element_ty),
             mask=q_mask)


def paged_rows_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: PagedRows, scaling: float,
    window: int | None, out: torch.Tensor, block_size: int,
) -> None:
    """Fills OUT's ROWS: query, out [total, heads, head_dim]; keys, values the layer's pool [slots, kv_heads,
    head_dim]; WINDOW the layer's sliding window (None: all the row's entries)."""
    num_rows = rows.row_index.shape[0]
    if num_rows == 0:
        return
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = keys.shape[1]
    grid = (num_rows, kv_heads)
    _paged_rows_kernel[grid](
        query, keys, values, out, rows.row_index, rows.block_tables, rows.num_cached, rows.key_end, rows.ancestors,
        rows.positions, scaling, window or NO_WINDOW,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), out.stride(0), out.stride(1),
        rows.block_tables.stride(0),
        heads_per_kv_head=heads // kv_heads, head_dim=head_dim, block_size=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(heads // kv_heads)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=KEYS_PER_TILE, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
