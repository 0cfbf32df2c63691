"""Paged attention for causal chains and small draft trees on a GPU (decoding, verifying drafts, prefill chunks of up
to `TRITON_MAX_CHAIN_LEN` tokens, engine/model/packed_runner.py): one Triton kernel reads each row's keys and values
where they lie in the pool, through its sequence's block table, so nothing is gathered.

A row is one new token: its query, its sequence's block table, the sequence's cached entries (all visible) and which
of the step's new entries it sees (`ancestors`, a bit each: a chain's rows up to itself, a tree node's path; tree
nodes' entries lie in list order after the cached ones, engine/model/forward.py; a chain longer than that many bits
counts its earlier rows as cached, engine/model/attention_layout.py). A layer's sliding window counts back from the
row's position over the entries at their positions (cached ones, a chain's); a tree node's new entries are within any
window wider than MAX_PAGED_ROWS_QUERY_LEN, which the runner checks.

Programs per (row, KV head, split): each computes the query heads that share the KV head together, with an online
softmax over tiles of keys in float32, over its split of the row's keys. One decoding row of an 8-KV-head model would
otherwise keep 8 of a GPU's ~130 SMs busy reading its whole context, so a step of few rows splits each row's keys
(`num_splits`) and a second kernel rescales the splits to their common max and sums them, as vLLM's paged attention
v2 and flash-decoding do; a step of many rows reaches every SM without splitting and takes one pass. A row's result
depends on the split count, as the GEMMs' rounding on a GPU depends on the rows' count; a row whose keys fit one
split gets the one-pass result bit for bit. The kernels have fixed shapes once the rows' count and the block tables'
width are fixed: CUDA graphs capture them (engine/model/cuda_graphs.py).
Imported only where the runner attends on a GPU; `TRITON_INTERPRET=1` runs it on a CPU (tests/engine/model).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.model.attention_layout import PagedRows

KEYS_PER_TILE = 64
MAX_SPLITS = 16  # programs per (row, KV head) at most, each over its own range of the row's keys
INTERPRETER_PROCESSORS = 8  # the "SMs" Triton's interpreter (the CPU tests) splits for: small batches split in two
NO_WINDOW = 2**30  # the window of a layer without one: wider than any context


@triton.jit
def _paged_rows_kernel(
    query, keys, values, out, part_acc, part_max, part_sum, row_index, block_tables, num_cached, key_end, ancestors,
    positions, scale, window,
    stride_q_row, stride_q_head, stride_k_slot, stride_k_head, stride_o_row, stride_o_head, stride_table,
    num_heads: tl.constexpr, heads_per_kv_head: tl.constexpr, head_dim: tl.constexpr, block_size: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One split of one row's keys for the query heads of one KV head: its softmax's running max, sum and weighted
    values, unnormalised, into the partial buffers [row, head, split(, dim)] (an empty split: max -inf, sum 0, no
    values); with one split, the row's output itself. A row's splits are whole tiles of its keys' indices."""
    program, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(row_index + program)
    cached = tl.load(num_cached + program)
    count = tl.load(key_end + program)
    seen = tl.load(ancestors + program)
    start = tl.maximum(tl.load(positions + program) - window + 1, 0)
    split_keys = tl.maximum(tl.cdiv(tl.cdiv(count, NUM_SPLITS), BLOCK_N), 1) * BLOCK_N
    low = tl.maximum(split * split_keys, (start // BLOCK_N) * BLOCK_N)
    high = tl.minimum((split + 1) * split_keys, count)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * heads_per_kv_head + g
    q_mask = (g[:, None] < heads_per_kv_head) & (d[None, :] < head_dim)
    q = tl.load(query + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :], mask=q_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(low, high, BLOCK_N):
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
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of keys the row does not see: weights 0
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if NUM_SPLITS == 1:  # the row's whole result: no partials, no second kernel
        tl.store(out + row * stride_o_row + heads[:, None] * stride_o_head + d[None, :],
                 (acc / l_i[:, None]).to(out.dtype.element_ty), mask=q_mask)
    else:
        stats = (program * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_max + stats, m_i, mask=g < heads_per_kv_head)
        tl.store(part_sum + stats, l_i, mask=g < heads_per_kv_head)
        tl.store(part_acc + stats[:, None] * head_dim + d[None, :], acc,
                 mask=q_mask & (tl.zeros([BLOCK_G, 1], tl.int32) + low < high))


@triton.jit
def _combine_splits_kernel(
    out, part_acc, part_max, part_sum, row_index, stride_o_row, stride_o_head,
    num_heads: tl.constexpr, heads_per_kv_head: tl.constexpr, head_dim: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """One row's query heads of one KV head: their splits' partial softmaxes rescaled to their common max and summed
    in split order. A row whose keys all lie in one split gets that split's acc / sum unchanged (the others weigh
    exactly 0)."""
    program, kv_head = tl.program_id(0), tl.program_id(1)
    row = tl.load(row_index + program)
    g = tl.arange(0, BLOCK_G)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * heads_per_kv_head + g
    head_mask = g < heads_per_kv_head
    stats = (program * num_heads + heads) * NUM_SPLITS  # [G] each head's first split
    maxes = tl.load(part_max + stats[:, None] + s[None, :], mask=head_mask[:, None], other=0.0)
    weights = tl.exp(maxes - tl.max(maxes, axis=1)[:, None])
    total = tl.sum(tl.load(part_sum + stats[:, None] + s[None, :], mask=head_mask[:, None], other=0.0) * weights,
                   axis=1)
    total = tl.where(head_mask, total, 1.0)  # the padding heads' lanes, never stored
    out_mask = head_mask[:, None] & (d[None, :] < head_dim)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        weight = tl.sum(tl.where(s[None, :] == split, weights, 0.0), axis=1)  # [G]
        used = out_mask & (weight[:, None] > 0)  # an empty split wrote no values
        acc += tl.load(part_acc + (stats[:, None] + split) * head_dim + d[None, :], mask=used, other=0.0) * (
            weight[:, None])
    tl.store(out + row * stride_o_row + heads[:, None] * stride_o_head + d[None, :],
             (acc / total[:, None]).to(out.dtype.element_ty), mask=out_mask)


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
    splits = num_splits(num_rows, kv_heads, query.device)
    part_acc = part_max = part_sum = out  # one pass writes OUT itself: no partials
    if splits > 1:
        part_acc = torch.empty(num_rows, heads, splits, head_dim, dtype=torch.float32, device=query.device)
        part_max, part_sum = (torch.empty(num_rows, heads, splits, dtype=torch.float32, device=query.device)
                              for _ in range(2))
    block_g, block_d = max(16, triton.next_power_of_2(heads // kv_heads)), max(16, triton.next_power_of_2(head_dim))
    _paged_rows_kernel[(num_rows, kv_heads, splits)](
        query, keys, values, out, part_acc, part_max, part_sum, rows.row_index, rows.block_tables, rows.num_cached,
        rows.key_end, rows.ancestors, rows.positions, scaling, window or NO_WINDOW,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), out.stride(0), out.stride(1),
        rows.block_tables.stride(0),
        num_heads=heads, heads_per_kv_head=heads // kv_heads, head_dim=head_dim, block_size=block_size,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=KEYS_PER_TILE,
        NUM_SPLITS=splits, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    if splits == 1:
        return
    _combine_splits_kernel[(num_rows, kv_heads)](
        out, part_acc, part_max, part_sum, rows.row_index, out.stride(0), out.stride(1),
        num_heads=heads, heads_per_kv_head=heads // kv_heads, head_dim=head_dim, BLOCK_G=block_g, BLOCK_D=block_d,
        NUM_SPLITS=splits,
    )


def num_splits(num_rows: int, kv_heads: int, device: torch.device) -> int:
    """Splits per (row, KV head): enough programs to reach every SM once (a power of two, at most MAX_SPLITS), none
    where the rows alone do. Measured on an H100 (8B shape, 512 keys a row): 16 splits cut a decoding step at batch 1
    from 7.38 to 7.16 ms and made verification of 16-64 rows per step 15-50% dearer, partials and all. The count is
    a function of the rows' count rounded up to a power of two, so a CUDA graph (rows padded to its ladder size,
    engine/model/cuda_graphs.py) and the eager step it replaces split alike."""
    processors = _multiprocessors(device.index) if device.type == "cuda" else INTERPRETER_PROCESSORS
    programs = triton.next_power_of_2(num_rows) * kv_heads
    splits = 1
    while splits < MAX_SPLITS and programs * splits * 2 <= processors:
        splits *= 2
    return splits


@functools.cache
def _multiprocessors(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
