"""Paged KV pool and the attention function of a packed, ragged forward.

All scheduled sequences' new tokens travel in one sequence `[1, total_new_tokens]`. Each layer writes its new keys and
values into the shared pool at the slots the forward items give, then attends, for every sequence, over its own keys
in the pool as its layout says (engine/model/attention_layout.py: a causal chain, or a tree whose tokens see their
ancestors only). The lean decoder (engine/model/decoder.py) calls `paged_attention`, or `attend` where its fused
rotary has written the keys and values; other architectures reach it through transformers' public
AttentionInterface, so their model code stays transformers'. Backends, chosen at start-up:
- `sdpa` (CPU and CUDA): short query runs (decoding, verifying drafts) are grouped, their keys and values gathered from
  the pool block-wise and attended in one call (on CPU, batched matmuls over gathered blocks outrun one in-place call
  per request). A long prefill chunk whose context lies in one contiguous run of the pool (the block manager usually
  places it so) is attended on a view of the pool, nothing copied; otherwise gathered, in a call of its own. With the
  CPU row kernel every sequence is read in place at its block table's slots, wherever its blocks lie, short runs
  included (one C++ call per layer for all of them, engine/model/csrc/fused_ops.cpp `spans_attention`).
- `triton` (CUDA with Triton, the default there): the short chains (decoding, verifying chains of drafts) through one
  Triton kernel that reads each row's keys where they lie in the pool, through its block table
  (engine/model/triton_attention.py): nothing gathered, fixed shapes for CUDA graphs. Trees and long prefill chunks
  go through SDPA as above, in the same step.
- `flash` (CUDA with flash-attn installed): one `flash_attn_varlen_func` call reads the pool through the block tables
  for the batch's chains; a tree in the same batch goes through SDPA. Imported lazily.
Captures: the attention rows of chosen heads are recomputed here (softmax(q k^T * scale) under the sequence's mask),
since SDPA and flash-attn return no weights.
Sliding windows: a layer that has one (`sliding_window`: Gemma 2/3's local layers, Mistral, Phi-3) attends, on every
path and in the captures, to the keys whose positions are above the query's minus the window: SDPA and the CPU paths
through the layout's mask narrowed to the window (attention_layout.windowed_mask, made once per step and window),
flash-attn through its own `window_size` (a chain's keys sit at their positions). KV outside every window of a
sequence is not freed: it stays in the pool, and only attention skips it.
"""
from __future__ import annotations

import importlib.util
import math
import mmap
import os
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.model.attention_layout import (
    KEY_MULTIPLE,
    AttentionGroup,
    FlashMetadata,
    InPlaceSpan,
    MaskPositions,
    PagedRows,
    windowed_mask,
)
from engine.model.cpu_kernels import row_attention_available

ATTENTION_NAME = "specserve_paged"
FLASH_BLOCK_SIZE = 256  # flash-attn's paged KV needs blocks of a multiple of 256 positions
MAX_GROUPED_QUERY_LEN = 16  # sequences with at most this many new tokens share one padded attention call
ROW_MULTIPLE = 4  # query rows per KV head of a CPU attention call are padded to a multiple of this (batch invariance)
SUM_COLUMNS = 16  # the softmax's sum as a matmul by ones: one vector of columns (a single column takes another path)


def kv_shape(model_config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers model config: the shape of one pool slot."""
    head_dim = (getattr(model_config, "head_dim", None)
                or model_config.hidden_size // model_config.num_attention_heads)
    return model_config.num_hidden_layers, model_config.num_key_value_heads, head_dim


class PagedKVPool:
    """Keys and values of every layer: `[num_layers, num_slots, kv_heads, head_dim]`, slot = block * size + offset.

    On the CPU that shape is a view of memory laid out head by head, `[num_layers, kv_heads, num_slots, head_dim]`: a
    KV head's keys at consecutive slots are then consecutive in memory, and the row kernel, which reads one KV head's
    keys at a time, streams them; slot by slot it read a third of every 768 bytes (SmolLM2's 3 heads) and attention
    over keys that had left the caches took 1.6x as long at 1,024 positions and 2x at 2,048 (the keys of all 30
    layers in turn, a weight-sized read between layers; bench/README.md). On CUDA the slots stay outermost, the paged
    layout flash-attn reads."""

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        device = torch.device(device)
        self.keys = _pool_tensor(num_layers, num_slots, num_kv_heads, head_dim, dtype, device)
        self.values = _pool_tensor(num_layers, num_slots, num_kv_heads, head_dim, dtype, device)
        # each layer's [num_slots, kv_heads, head_dim], views made once: a layer indexes no tensor to reach its own
        self.layer_keys, self.layer_values = self.keys.unbind(0), self.values.unbind(0)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """key, value: [n, kv_heads, head_dim]; slots: [n]."""
        self.layer_keys[layer].index_copy_(0, slots, key)
        self.layer_values[layer].index_copy_(0, slots, value)

    def move(self, moves: list[tuple[int, int]]) -> None:
        """Copy each (from slot, to slot) pair's keys and values in every layer, in order."""
        for source, target in moves:
            self.keys[:, target] = self.keys[:, source]
            self.values[:, target] = self.values[:, source]


def _pool_tensor(
    num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
) -> torch.Tensor:
    """Zeros [num_layers, num_slots, kv_heads, head_dim]: on the CPU a view of head-major memory (PagedKVPool)."""
    if device.type != "cpu":
        return slot_major_zeros(num_layers, num_slots, num_kv_heads, head_dim, dtype, device)
    return _zeros((num_layers, num_kv_heads, num_slots, head_dim), dtype, device).transpose(1, 2)


def slot_major_zeros(
    num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
) -> torch.Tensor:
    """Zeros [num_layers, num_slots, kv_heads, head_dim] laid out slot by slot: CUDA's pool (what flash-attn reads)."""
    return _zeros((num_layers, num_slots, num_kv_heads, head_dim), dtype, device)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros. On the CPU, an anonymous mapping the OS zeroes page by page as each is first touched: a pool of
    gigabytes then costs neither seconds of filling at start-up (3.8 s for the default 2 GiB on a 2-core host) nor
    resident memory before its blocks are used; page-aligned (torch aligns its own to 64 bytes). Without transparent
    huge pages (MADV_NOHUGEPAGE, where the OS has them): a request's first tokens in a fresh part of the pool would
    otherwise fault in and zero 2 MiB in each layer's keys and values (72 MiB for an 18-layer model) where it writes
    kilobytes, and on a virtual machine whose memory the host had not yet backed that took 90-290 ms a request."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    memory = mmap.mmap(-1, max(num_bytes, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.uint8, count=num_bytes).view(dtype).view(shape)


@dataclass
class AttentionCapture:
    """Attention rows to return for one sequence: every capture head at QUERY_INDEX, over its CONTEXT_LEN keys."""

    item: int  # the sequence's index in the batch
    query_index: torch.Tensor  # [rows] packed indices of the queries
    block_table: torch.Tensor  # [blocks] the sequence's pool blocks
    context_len: int
    mask: torch.Tensor  # [rows, context_len] True where a query may look
    positions: MaskPositions | None = None  # the query and key positions sliding windows compare


@dataclass
class PackedBatch:
    """Where each sequence's tokens sit in the packed sequence and in the pool, and what the layers capture."""

    pool: PagedKVPool
    block_size: int  # positions per block of the block tables
    write_slots: torch.Tensor  # [total_new_tokens] pool slots of the new tokens
    groups: list[AttentionGroup] = field(default_factory=list)  # sdpa: sequences whose blocks are gathered
    spans: list[InPlaceSpan] = field(default_factory=list)  # sdpa: sequences read in place
    span_table: tuple | None = None  # the spans' query starts and lengths and key slots (row kernel)
    in_place: dict = field(default_factory=dict)  # (window, rows) -> `in_place_spans`, the same in every layer
    flash: FlashMetadata | None = None  # flash: the chains
    paged_rows: PagedRows | None = None  # triton: the short chains' rows (engine/model/triton_attention.py)
    capture_heads: dict[int, list[int]] = field(default_factory=dict)  # layer -> query heads whose rows are captured
    attention_captures: list[AttentionCapture] = field(default_factory=list)
    # (item, layer) -> [rows, heads, L]
    captured_attention: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    hidden_layers: tuple[int, ...] = ()  # capture the residual stream after each of these many decoder layers
    hidden_index: torch.Tensor | None = None  # [n] packed indices whose hidden states are kept
    hidden_every_row: bool = False  # ... and they are every packed row, in order (a decode step's, a prompt chunk's)
    # [n, hidden_size * capture layers] float32 on the host: the kept rows, each layer's columns in the order asked
    captured_hidden: torch.Tensor | None = None
    _hidden_columns: tuple[torch.Tensor, ...] = ()  # its columns of each capture layer

    def keep_hidden(self, num_layers_done: int, hidden: torch.Tensor) -> None:
        """Keep the asked rows of HIDDEN [total, hidden_size], the residual stream after NUM_LAYERS_DONE layers, if
        that is a capture layer: copied into their columns of the one host buffer the layers share (a step that
        keeps every row copies HIDDEN as it is; no per-layer tensors to join afterwards)."""
        if self.hidden_index is None or num_layers_done not in self.hidden_layers:
            return
        rows = hidden if self.hidden_every_row else hidden.index_select(0, self.hidden_index)
        if self.captured_hidden is None:
            self.captured_hidden = torch.empty(len(self.hidden_index), hidden.shape[1] * len(self.hidden_layers))
            self._hidden_columns = self.captured_hidden.chunk(len(self.hidden_layers), dim=1)
        for layer, columns in zip(self.hidden_layers, self._hidden_columns):
            if layer == num_layers_done:
                columns.copy_(rows)

    def hidden_states(self) -> torch.Tensor | None:
        """[n, hidden_size * capture layers] the kept rows, the layers side by side in the order asked."""
        return self.captured_hidden if self.hidden_index is not None else None


def _head_major(layer_pool: torch.Tensor) -> bool:
    """Whether a layer's [num_slots, kv_heads, head_dim] pool lies head by head in memory (the CPU's: PagedKVPool)."""
    return layer_pool.shape[1] > 1 and layer_pool.stride(1) > layer_pool.stride(0)


def _gather_blocks(
    layer_pool: torch.Tensor, block_table: torch.Tensor, block_size: int, max_len: int,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_slots, kv_heads, head_dim] -> [R, L, kv_heads, head_dim] for block_table [R, blocks]: whole blocks copied
    (INTO, when given, a buffer of the right size reused from layer to layer: fresh pages cost more than the copy),
    laid out as the pool is (`_gathered_slots` reads INTO by slot either way)."""
    num_reqs, num_blocks = block_table.shape
    kv_heads, head_dim = layer_pool.shape[1:]
    if _head_major(layer_pool):
        by_block = layer_pool.transpose(0, 1).view(kv_heads, -1, block_size * head_dim)
        out = into.view(kv_heads, -1, block_size * head_dim) if into is not None else None
        gathered = torch.index_select(by_block, 1, block_table.flatten(), out=out)
        return gathered.view(kv_heads, num_reqs, num_blocks * block_size, head_dim).permute(1, 2, 0, 3)[:, :max_len]
    by_block = layer_pool.view(-1, block_size * kv_heads * head_dim)
    gathered = (torch.index_select(by_block, 0, block_table.flatten(), out=into) if into is not None
                else by_block.index_select(0, block_table.flatten()))
    return gathered.view(num_reqs, num_blocks * block_size, kv_heads, head_dim)[:, :max_len]


def _gathered_slots(into: torch.Tensor, layer_pool: torch.Tensor) -> torch.Tensor:
    """INTO, a buffer `_gather_blocks` filled from LAYER_POOL, as [gathered slots, kv_heads, head_dim]."""
    kv_heads, head_dim = layer_pool.shape[1:]
    if _head_major(layer_pool):
        return into.view(kv_heads, -1, head_dim).transpose(0, 1)
    return into.view(-1, kv_heads, head_dim)


def _gather_group(layer_pool: torch.Tensor, group: AttentionGroup, into: torch.Tensor) -> torch.Tensor:
    """The group's keys (or values) gathered INTO its scratch buffer, tree paths' node keys put in their places."""
    gathered = _gather_blocks(layer_pool, group.block_table, group.block_size, group.max_len, into)
    if group.tail_slots is not None:
        _gathered_slots(into, layer_pool).index_copy_(0, group.tail_keys, layer_pool[group.tail_slots])
    return gathered


def _attend_heads_as_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: AttentionGroup | InPlaceSpan, scaling: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """SDPA for grouped-query attention with the query heads that share a KV head folded into extra query rows of
    that head, so every KV head is read once (on CPU cheaper than `enable_gqa`, which reads it per query head).

    q [R, heads, Q, head_dim]; k, v [R, kv_heads, L, head_dim]; WHERE's mask [R, 1, Q * heads / kv_heads, L]
    (already tiled), narrowed to the sliding WINDOW if any -> [R, heads, Q, head_dim].
    """
    num_reqs, heads, query_len, head_dim = q.shape
    rows = q.reshape(num_reqs, k.shape[1], heads // k.shape[1] * query_len, head_dim)
    scale = scaling if scaling is not None else head_dim ** -0.5
    mask = windowed_mask(where.mask, where.positions, window)
    if rows.device.type == "cpu" and _row_kernel_runs():
        o = torch.ops.specserve.row_attention(rows, k, v, mask, scale, heads // k.shape[1])
    elif rows.device.type == "cpu":
        o = _row_invariant_attention(rows, k, v, _blocked_of(where, mask, window), scale)
    else:
        o = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scaling)
    return o.reshape(num_reqs, heads, query_len, head_dim)  # CUDA kernels may return other strides


def _span_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, span: InPlaceSpan, scaling: float,
    window: int | None,
) -> torch.Tensor:
    """The row kernel over SPAN's keys where they lie in the layer's pool (KEYS, VALUES [slots, kv_heads, head_dim]):
    query [Q, heads, head_dim] -> [Q, heads, head_dim], the views and the folding of query heads into rows made in
    one C++ call (engine/model/csrc/fused_ops.cpp), the same arithmetic as `_attend_heads_as_rows`'."""
    mask = windowed_mask(span.mask, span.positions, window)
    return torch.ops.specserve.span_attention(query, keys, values, span.key_slots, mask, scaling)


def _spans_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: PackedBatch, scaling: float,
    window: int | None, out: torch.Tensor,
) -> None:
    """`_span_attention` for every span of BATCH, in one C++ call that writes their rows of OUT (decoding several
    requests: no Python per request)."""
    masks = [windowed_mask(span.mask, span.positions, window) for span in batch.spans]
    torch.ops.specserve.spans_attention(query, keys, values, *_span_table(batch), masks, scaling, out)


def _span_table(batch: PackedBatch) -> tuple:
    """The spans' query starts and lengths and key slots: the same in every layer of the step."""
    if batch.span_table is None:
        batch.span_table = tuple([getattr(span, name) for span in batch.spans]
                                 for name in ("query_start", "query_len", "key_slots"))
    return batch.span_table


def in_place_spans(batch: PackedBatch, window: int | None, num_rows: int) -> tuple | None:
    """(query starts, query lengths, key slots, masks narrowed to WINDOW) of BATCH's spans, when
    the CPU row kernel attends all NUM_ROWS of its rows in place and nothing else is asked of the layer's attention
    (engine/model/csrc/decoder_layer.cpp runs the whole layer then); else None. Made once per step and window."""
    key = (window, num_rows)
    if key not in batch.in_place:
        batch.in_place[key] = _in_place_spans(batch, window, num_rows)
    return batch.in_place[key]


def _in_place_spans(batch: PackedBatch, window: int | None, num_rows: int) -> tuple | None:
    if (batch.groups or batch.flash is not None or batch.capture_heads or not batch.spans
            or batch.pool.keys.device.type != "cpu" or not _row_kernel_runs()):
        return None
    table = _span_table(batch)
    if sum(table[1]) != num_rows:
        return None
    return (*table, [windowed_mask(span.mask, span.positions, window) for span in batch.spans])


@cache
def _row_kernel_runs() -> bool:
    """Whether CPU attention runs specserve's row kernel (engine/model/csrc/row_attention.cpp, AVX-512 or AVX2)
    rather than the batched matmuls below: the same answer all process long, so every forward computes a row the
    same way."""
    return row_attention_available()


def skips_masked_keys(device: torch.device) -> bool:
    """Whether attention on DEVICE skips masked keys (the CPU row kernel): then a tree can be attended in place with
    each row's bits those of its path drafted as a chain (engine/model/attention_layout.py), and a sequence read in
    place pays nothing for the padding keys after its own."""
    return device.type == "cpu" and _row_kernel_runs()


def _blocked_of(where: AttentionGroup | InPlaceSpan, mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """`_blocked` of WHERE's MASK (its full mask or its narrowing to WINDOW): the same in every layer of the step
    that has that window, so made once."""
    key = None if mask is where.mask else window
    blocked = where.blocked.get(key)
    if blocked is None:
        blocked = where.blocked[key] = _blocked(mask)
    return blocked


def _blocked(mask: torch.Tensor) -> torch.Tensor:
    """The CPU path's mask: True where a query may NOT look, rows padded to a multiple of ROW_MULTIPLE with rows
    that see every key (zero queries: finite, dropped)."""
    extra = -mask.shape[2] % ROW_MULTIPLE
    return ~F.pad(mask, (0, 0, 0, extra), value=True) if extra else ~mask


def _row_invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor, scaling: float
) -> torch.Tensor:
    """softmax(q k^T * scale) v in plain batched matmuls (keys read where they lie, nothing copied), the softmax's sum
    a matmul as well; every row comes out bit for bit the same whatever the other rows, the padding keys and the
    masked keys between its own (see engine/model/attention_layout.py), which CPU SDPA's fused kernel does not give.
    q [R, kv_heads, rows, d]; k, v [R, kv_heads, L, d]; blocked [R, 1, padded rows, L] (`_blocked`)."""
    num_rows = q.shape[2]
    extra = blocked.shape[2] - num_rows
    if extra:
        q = F.pad(q, (0, 0, 0, extra))
    scores = _matmuls(q, k.transpose(2, 3)).mul_(scaling).masked_fill_(blocked, float("-inf"))
    weights = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
    total = _sum_over_keys(weights, _summing_ones(q, k.shape[1], k.shape[2]).expand(k.shape[0], -1, -1, -1))[..., :1]
    return _sum_over_keys(weights, v).div_(total)[:, :, :num_rows]


def _sum_over_keys(weights: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """weights [R, H, m, L] @ b [R, H, L, n] with L a multiple of KEY_MULTIPLE (padded_key_len), summed over the keys
    KEY_MULTIPLE at a time: one batched product of every chunk, then the chunks' sums added in key order (a running
    sum). Every product reduces the same number of keys whatever L is, so no BLAS groups a row's sum differently
    when padding or another request makes L longer (MKL does above 384 keys on some CPUs), and the masked keys'
    chunks add exact zeros. It costs the path without the row kernel about a fifth of a decoding step."""
    num_reqs, heads, num_rows, num_keys = weights.shape
    num_chunks = num_keys // KEY_MULTIPLE
    chunks = weights.reshape(num_reqs, heads, num_rows, num_chunks, KEY_MULTIPLE).transpose(2, 3)
    parts = torch.matmul(chunks, b.reshape(num_reqs, heads, num_chunks, KEY_MULTIPLE, b.shape[-1]))
    return parts.cumsum(dim=2)[:, :, -1]  # [R, H, m, n]


_ONES: dict[tuple, torch.Tensor] = {}


def _summing_ones(like: torch.Tensor, kv_heads: int, num_keys: int) -> torch.Tensor:
    """[kv_heads, num_keys, SUM_COLUMNS] ones (a view of one buffer kept per kind, grown as contexts grow)."""
    key = (kv_heads, like.dtype, like.device)
    ones = _ONES.get(key)
    if ones is None or ones.shape[1] < num_keys:
        ones = _ONES[key] = like.new_ones(
            kv_heads, max(num_keys, 2 * (ones.shape[1] if ones is not None else 1024)), SUM_COLUMNS
        )
    return ones[:, :num_keys]


def _matmuls(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [R, H, m, k] @ b [R, H, k, n] -> [R, H, m, n] as batched matmuls over one request's heads or one head's
    requests, whichever makes fewer calls (the KV's [L, kv_heads, d] layout folds only one of the two into a batch
    without a copy). Each matrix product is computed alone either way: the same numbers, measured."""
    num_reqs, heads = a.shape[:2]
    if num_reqs == 1:
        return torch.bmm(a[0], b[0])[None]
    if num_reqs <= heads:
        return torch.stack([torch.bmm(a[r], b[r]) for r in range(num_reqs)])
    return torch.stack([torch.bmm(a[:, h], b[:, h]) for h in range(heads)], dim=1)


def _sdpa(
    packed_query: torch.Tensor, layer: int, batch: PackedBatch, scaling: float | None, out: torch.Tensor,
    window: int | None = None,
) -> None:
    """packed_query, out: [total, heads, head_dim]; fills the rows of the grouped and in-place sequences."""
    keys, values = batch.pool.layer_keys[layer], batch.pool.layer_values[layer]
    for group in batch.groups:
        num_reqs, max_q = group.query_index.shape
        q = packed_query[group.query_index].transpose(1, 2)  # [R, heads, Q, head_dim]
        if group.scratch is None:  # the same size in every layer of the step
            group.scratch = keys.new_empty(
                2, group.block_table.numel(), group.block_size * keys.shape[1] * keys.shape[2]
            )
        k = _gather_group(keys, group, group.scratch[0]).transpose(1, 2)
        v = _gather_group(values, group, group.scratch[1]).transpose(1, 2)
        o = _attend_heads_as_rows(q, k, v, group, scaling, window).transpose(1, 2)  # [R, Q, heads, head_dim]
        out[group.packed_index] = o.reshape(num_reqs * max_q, *o.shape[2:])[group.valid]
    if batch.spans and packed_query.device.type == "cpu" and _row_kernel_runs():
        _spans_attention(packed_query, keys, values, batch, scaling, window, out)
        return
    for span in batch.spans:
        queries = slice(span.query_start, span.query_start + span.query_len)
        positions = slice(span.first_slot, span.first_slot + span.context_len)
        q = packed_query[queries].transpose(0, 1)[None]  # [1, heads, Q, head_dim]
        k = keys[positions].transpose(0, 1)[None]  # [1, kv_heads, L, head_dim], a view of the pool
        v = values[positions].transpose(0, 1)[None]
        out[queries] = _attend_heads_as_rows(q, k, v, span, scaling, window)[0].transpose(0, 1)


def _flash(
    packed_query: torch.Tensor, layer: int, batch: PackedBatch, scaling: float | None, out: torch.Tensor,
    window: int | None = None,
) -> None:
    """Fills the chains' rows. A chain's keys sit at their positions, so flash-attn's window, counted back from each
    query's own key, is the sliding window: window - 1 keys before it and itself."""
    from flash_attn import flash_attn_varlen_func  # CUDA only; CPU installs never import it

    meta, pool = batch.flash, batch.pool
    num_slots, kv_heads, head_dim = pool.keys.shape[1:]
    shape = (num_slots // FLASH_BLOCK_SIZE, FLASH_BLOCK_SIZE, kv_heads, head_dim)
    out[meta.query_index] = flash_attn_varlen_func(
        packed_query[meta.query_index],  # [n, heads, head_dim]
        pool.keys[layer].view(shape),
        pool.values[layer].view(shape),
        cu_seqlens_q=meta.cu_seqlens_q,
        cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        softmax_scale=scaling,
        causal=True,  # aligned to the bottom right: query i of q sees the first L - q + i + 1 positions
        window_size=(window - 1, 0) if window is not None else (-1, -1),
        block_table=meta.block_table,
    )


def _triton(
    packed_query: torch.Tensor, layer: int, batch: PackedBatch, scaling: float, out: torch.Tensor,
    window: int | None = None,
) -> None:
    """Fills the short chains' rows through the Triton kernel, each read where its blocks lie."""
    from engine.model.triton_attention import paged_rows_attention  # CUDA (or Triton's interpreter) only

    pool = batch.pool
    paged_rows_attention(packed_query, pool.layer_keys[layer], pool.layer_values[layer], batch.paged_rows, scaling,
                         window, out, batch.block_size)


def _capture_attention(
    packed_query: torch.Tensor, layer: int, batch: PackedBatch, scaling: float, window: int | None = None
) -> None:
    """The capture heads' attention rows of this layer, per sequence that asked: [rows, heads, L] each (zero on the
    keys outside the layer's sliding WINDOW)."""
    heads = batch.capture_heads.get(layer)
    if not heads:
        return
    heads_per_kv_head = packed_query.shape[1] // batch.pool.keys.shape[2]
    kv_heads = [head // heads_per_kv_head for head in heads]
    for capture in batch.attention_captures:
        table = capture.block_table[None]  # [1, blocks]
        # [L, kv_heads, d]
        keys = _gather_blocks(batch.pool.keys[layer], table, batch.block_size, capture.context_len)[0]
        q = packed_query[capture.query_index][:, heads].float()  # [rows, heads, head_dim]
        k = keys[:, kv_heads].float()  # [L, heads, head_dim]
        scores = torch.einsum("rhd,lhd->rhl", q, k) * scaling
        mask = windowed_mask(capture.mask, capture.positions, window)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        batch.captured_attention[(capture.item, layer)] = torch.softmax(scores, dim=-1)


def paged_attention(
    layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, packed_batch: PackedBatch,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Writes the new tokens' keys and values into the pool, then attends, within SLIDING_WINDOW positions of each
    query where the layer has one (keys outside it stay in the pool, unread). query [total, heads, head_dim]; key,
    value [total, kv_heads, head_dim] -> [total, heads, head_dim]."""
    packed_batch.pool.write(layer, key, value, packed_batch.write_slots)
    return attend(layer, query, scaling, packed_batch, sliding_window)


def attend(
    layer: int, query: torch.Tensor, scaling: float, packed_batch: PackedBatch, sliding_window: int | None = None,
) -> torch.Tensor:
    """`paged_attention` after the new tokens' keys and values are in the pool (the lean decoder's fused rotary
    writes them). A single sequence read in place with the CPU row kernel (decoding alone) is attended in one call,
    its output returned as it comes."""
    spans = packed_batch.spans
    if (len(spans) == 1 and not packed_batch.groups and packed_batch.flash is None and not packed_batch.capture_heads
            and spans[0].query_len == query.shape[0] and query.device.type == "cpu" and _row_kernel_runs()):
        pool = packed_batch.pool
        return _span_attention(query, pool.layer_keys[layer], pool.layer_values[layer], spans[0], scaling,
                               sliding_window)
    out = torch.empty_like(query)
    if packed_batch.flash is not None:
        _flash(query, layer, packed_batch, scaling, out, sliding_window)
    if packed_batch.paged_rows is not None:
        _triton(query, layer, packed_batch, scaling, out, sliding_window)
    _sdpa(query, layer, packed_batch, scaling, out, sliding_window)
    _capture_attention(query, layer, packed_batch, scaling, sliding_window)
    return out


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_batch: PackedBatch | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [1, heads, total, head_dim]; key, value [1, kv_heads, total, head_dim]
    -> [1, total, heads, head_dim]. The modules of windowed models pass their layer's SLIDING_WINDOW."""
    if packed_batch is None:
        raise ValueError(f"{ATTENTION_NAME} attention needs a packed_batch argument")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    packed = (t[0].transpose(0, 1) for t in (query, key, value))
    return paged_attention(module.layer_idx, *packed, scaling, packed_batch, sliding_window)[None], None


def flash_attn_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernel runs on DEVICE: a CUDA device with Triton installed, or any device under Triton's
    interpreter (TRITON_INTERPRET=1, how the CPU tests run it)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return importlib.util.find_spec("triton") is not None


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """AUTO: flash where flash-attn is installed, else triton on a CUDA device with Triton, else sdpa."""
    if backend == "auto":
        if flash_attn_available(device):
            return "flash"
        return "triton" if device.type == "cuda" and triton_available(device) else "sdpa"
    if backend == "flash" and not flash_attn_available(device):
        raise RuntimeError("--attention-backend flash needs a CUDA device and the flash-attn package")
    if backend == "triton" and not triton_available(device):
        raise RuntimeError("--attention-backend triton needs a CUDA device and the triton package")
    return backend


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
