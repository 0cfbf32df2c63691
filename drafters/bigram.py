"""The model bigram of the learning-free n-gram paper (§4.1): the target's own top next tokens after each bare token.

For every token x of the vocabulary, one forward of the target on x gives p(· | x); the
paper's code runs x alone, we run it after the model's BOS token (engine/drafter_context.py
says why: without it a small model's prediction ignores x). The table keeps its top
`TABLE_TOP_K` token ids ([vocab, TABLE_TOP_K] int32, about 5 MB for a 49k vocabulary;
the full V x V table would be ~10 GB). The extended bigram chains a candidate with the
table's argmax: x -> c, then argmax(c), argmax(argmax(c)), ... up to w tokens.

Built once per model and kept under the cache directory, named by a fingerprint of
the served weights; building it runs the target over the whole vocabulary in batches
(minutes on a small CPU for a 49k vocabulary), so the drafter builds it in the
background and drafts from the context alone until it is ready.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger("specserve.drafters")

TABLE_TOP_K = 25  # the largest k of the paper's grid
BUILD_BATCH_SIZE = 256  # bare tokens per forward while building
TABLE_FORMAT = 2  # bump when the table's meaning changes (2: each token after the BOS token)


class BigramTable:
    def __init__(self, top_ids: torch.Tensor) -> None:
        self.top_ids = top_ids  # [vocab, min(TABLE_TOP_K, vocab)] int32, most likely first
        self._argmax = top_ids[:, 0].tolist()  # [vocab] the extension's next token after each token
        self._top_rows: dict[int, list[int]] = {}  # token -> its top ids as a list, filled on use

    def rows(self, token: int, k: int, w: int) -> list[list[int]]:
        """The extended bigram's k rows of w tokens after TOKEN."""
        if token not in self._top_rows:
            self._top_rows[token] = self.top_ids[token].tolist()
        return [self._extend(first, w) for first in self._top_rows[token][:k]]

    def _extend(self, first: int, w: int) -> list[int]:
        row = [first]
        while len(row) < w:
            row.append(self._argmax[row[-1]])
        return row


def table_path(cache_dir: Path, model_fingerprint: str) -> Path:
    return cache_dir / "tables" / f"bigram-v{TABLE_FORMAT}-top{TABLE_TOP_K}-{model_fingerprint}.pt"


def build_bigram_table(
    next_token_logits: Callable[[list[int]], torch.Tensor], vocab_size: int,
    progress: Callable[[int, int], None] | None = None,
) -> BigramTable:
    """next_token_logits: [B] tokens -> [B, vocab] logits of the target's next token after each (DrafterContext)."""
    width = min(TABLE_TOP_K, vocab_size)
    top = torch.empty(vocab_size, width, dtype=torch.int32)
    for start in range(0, vocab_size, BUILD_BATCH_SIZE):
        tokens = list(range(start, min(start + BUILD_BATCH_SIZE, vocab_size)))
        logits = next_token_logits(tokens)
        top[start:start + len(tokens)] = torch.topk(logits.float(), width, dim=-1).indices.int()
        if progress:
            progress(start + len(tokens), vocab_size)
    return BigramTable(top)


def load_table(path: Path) -> BigramTable | None:
    if not path.is_file():
        return None
    return BigramTable(torch.load(path, weights_only=True))


def save_table(table: BigramTable, path: Path) -> None:
    """Written to a temporary name and renamed: a reader never sees half a table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    torch.save(table.top_ids, partial)
    os.replace(partial, path)


class LogProgress:
    """Logs a build's progress about every LOG_INTERVAL_S seconds."""

    LOG_INTERVAL_S = 10.0

    def __init__(self, what: str) -> None:
        self.what = what
        self.started = self.last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.LOG_INTERVAL_S or done == total:
            self.last = now
            logger.info("%s: %d of %d tokens (%.0f s)", self.what, done, total, now - self.started)


class BackgroundTable:
    """The table from the cache, or built in a background thread (and then cached); `table` is None until ready."""

    def __init__(self, path: Path, build: Callable[[], BigramTable]) -> None:
        self.path = path
        self.table: BigramTable | None = load_table(path)
        self.thread: threading.Thread | None = None
        if self.table is None:
            logger.info("no model bigram table at %s yet: building it in the background; context drafts meanwhile",
                        path)
            self.thread = threading.Thread(target=self._build, args=(build,), name="bigram-table", daemon=True)
            self.thread.start()

    def _build(self, build: Callable[[], BigramTable]) -> None:
        try:
            table = build()
            save_table(table, self.path)
            self.table = table
            logger.info("model bigram table ready and cached at %s", self.path)
        except Exception:  # a failed build leaves context drafts only; serving goes on
            logger.exception("building the model bigram table failed; drafting from the context only")

    def wait(self, timeout_s: float | None = None) -> BigramTable | None:
        if self.thread is not None:
            self.thread.join(timeout_s)
        return self.table
