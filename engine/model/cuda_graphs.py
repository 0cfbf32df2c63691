"""CUDA graphs of the lean forward for decoding and verifying steps (chains and trees of drafts).

On a GPU a decoding step of a small or mid-sized model is bound by launching its kernels from Python (hundreds per
step), not by the GPU. At start-up the runner captures one graph per padded token count of a ladder (GRAPH_TOKEN_COUNTS
up to --cuda-graph-max-tokens), the largest first, all in one memory pool. A step whose items are all chains (prefill
chunks included) or small trees the Triton kernel attends (`PackedModelRunner.paged_rows_fit`), asking for no
hidden-state or attention captures, whose token count fits the
ladder, copies its tokens, positions, slots and rows' attention metadata (block tables, cached counts, ancestor bits)
into the graphs' static buffers and replays the smallest graph that holds it; its attention is the Triton kernel
(engine/model/triton_attention.py), whose shapes are fixed once the rows' count and the block tables' width are. Rows
past the step's own are padding: token 0 at position 0, its KV written to a spare block no sequence owns, attending
to that one entry. Every other step (larger ones, trees the kernel cannot window, captures) runs eagerly. A graph
computes the logits of every
row; the step keeps those it asked for (verifier rows, then look-ahead rows, item by item).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from engine.model.attention_layout import PagedRows, RowTable
from engine.model.forward import ForwardBatch, ForwardItem
from engine.model.paged_attention import PackedBatch, PagedKVPool

logger = logging.getLogger(__name__)

GRAPH_TOKEN_COUNTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# Held while graphs are captured: a thread that runs the model beside the engine (the model bigram table's build)
# takes it around each forward on a GPU, since any CUDA call from another thread during a capture breaks it.
CAPTURE_LOCK = threading.Lock()
WARMUP_RUNS = 2  # eager runs of each size before its capture: Triton compiles its kernels, cuBLAS picks its plans


class CudaGraphs:
    """The captured graphs of one runner, their static inputs and their outputs."""

    def __init__(
        self, decoder, pool: PagedKVPool, block_size: int, spare_block: int, max_blocks: int,
        device: torch.device, max_tokens: int, kernel_attends: Callable[[ForwardItem], bool],
    ) -> None:
        self.decoder, self.pool, self.block_size = decoder, pool, block_size
        self.spare_block, self.spare_slot = spare_block, spare_block * block_size
        self.max_blocks, self.kernel_attends = max_blocks, kernel_attends
        self.sizes = [size for size in GRAPH_TOKEN_COUNTS if size <= max_tokens]
        n = self.sizes[-1]
        self.token_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.spare_slot, dtype=torch.long, device=device)
        self.row_index = torch.arange(n, dtype=torch.int32, device=device)
        self.tables = torch.full((n, max_blocks), spare_block, dtype=torch.int32, device=device)
        self.num_cached = torch.zeros(n, dtype=torch.int32, device=device)
        self.key_end = torch.ones(n, dtype=torch.int32, device=device)
        self.ancestors = torch.ones(n, dtype=torch.int64, device=device)
        self.row_positions = torch.zeros(n, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # size -> (graph, its logits)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, the largest first, sharing one memory pool; logs what it took."""
        with CAPTURE_LOCK:
            self._capture_all()

    def _capture_all(self) -> None:
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        memory_pool = None
        for size in reversed(self.sizes):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self._forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool):
                logits = self._forward(size)
            memory_pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs of 1..%d tokens in %.1f s, %.0f MiB", len(self.sizes), self.sizes[-1],
                    time.perf_counter() - start, (torch.cuda.memory_reserved() - reserved) / 2**20)

    def _forward(self, size: int) -> torch.Tensor:
        packed = PackedBatch(self.pool, self.block_size, self.slots[:size])
        packed.paged_rows = PagedRows(self.row_index[:size], self.tables[:size], self.num_cached[:size],
                                      self.key_end[:size], self.ancestors[:size], self.row_positions[:size])
        return self.decoder(self.token_ids[:size], self.positions[:size], self.rows[:size], packed)

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether a captured graph computes BATCH: items the Triton kernel attends, no captures or prompt rows, and its
        tokens and block tables within the graphs' buffers."""
        return bool(self.graphs) and sum(item.num_tokens for item in batch.items) <= self.sizes[-1] and all(
            self.kernel_attends(item) and not item.hidden_rows and not item.attention_rows and not item.prompt_rows
            and -(-item.context_len // self.block_size) <= self.max_blocks
            for item in batch.items
        )

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """[logit rows of every item, in order, vocab] from a replay of the smallest graph that holds BATCH."""
        total = sum(item.num_tokens for item in batch.items)
        size = next(s for s in self.sizes if s >= total)
        self._fill(batch, total, size)
        graph, logits = self.graphs[size]
        graph.replay()
        rows, start = [], 0
        for item in batch.items:
            rows += [start + row for row in item.logit_rows + item.drafter_rows]
            start += item.num_tokens
        return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]

    def _fill(self, batch: ForwardBatch, total: int, size: int) -> None:
        """Copy BATCH's rows into the static buffers, padding rows after them up to SIZE (each sees the spare block's
        first entry only)."""
        padding = size - total
        token_ids = [t for item in batch.items for t in item.token_ids] + [0] * padding
        positions = [p for item in batch.items for p in item.positions] + [0] * padding
        slots = [s for item in batch.items for s in item.slots] + [self.spare_slot] * padding
        rows, start = RowTable(), 0
        for item in batch.items:
            rows.add(start, item, self.block_size)
            start += item.num_tokens
        tables = rows.padded_tables(self.spare_block)
        width = len(tables[0])
        tables += [[self.spare_block] * width] * padding
        self.token_ids[:size].copy_(torch.tensor(token_ids))
        self.positions[:size].copy_(torch.tensor(positions))
        self.slots[:size].copy_(torch.tensor(slots))
        self.tables[:size, :width].copy_(torch.tensor(tables, dtype=torch.int32))
        self.num_cached[:size].copy_(torch.tensor(rows.num_cached + [0] * padding, dtype=torch.int32))
        self.key_end[:size].copy_(torch.tensor(rows.key_end + [1] * padding, dtype=torch.int32))
        self.ancestors[:size].copy_(torch.tensor(rows.ancestors + [1] * padding, dtype=torch.int64))
        self.row_positions[:size].copy_(torch.tensor(rows.positions + [0] * padding, dtype=torch.int32))
