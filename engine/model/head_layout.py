"""The attention layout of a head's forwards on the CPU: each request's chain of tokens attending in place to every
position of its request up to its own (engine/model/csrc/decoder_layer.cpp's spans), laid out without the packed
runner.

A drafting round runs one head forward per drafted position: the first reads the request's unread real tokens, each
next one a drafted token per request. At one row the runner's generic layout (items, members, masks, key slots,
captures, the output's split) cost as much as the head's layer itself. The key slots of a request's padded context
are the same from one forward of a round to the next (the context grows by one inside the same padded length), so
they are kept, bounded.

A greedy request's tree (drafters/head_draft.py) lays out as one span of its nodes at a depth: each row at its depth's
position, written at a slot of its own past the request's real tokens (`TreeRows`), and seeing the real tokens, its
ancestors' slots and its own.
"""
from __future__ import annotations

import torch

from drafters.tree import TreeRows
from engine.model.attention_layout import key_slots, padded_key_len
from engine.model.forward import slots_of

MAX_KEPT = 1024  # key-slot tensors kept; all are dropped when more would be


class HeadLayout:
    """Token ids, positions, write slots and spans of chains, as the head's lean layer takes them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._slots: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}  # (blocks read, keys) -> key slots
        self._indices = torch.arange(0)

    def lay_out(self, chains: list[tuple]) -> tuple[torch.Tensor, ...]:
        """CHAINS: (token ids, position of the first, block table[, TreeRows]) per request -> token ids, positions and
        pool slots written [rows], the rows whose logits are kept [kept] (None where that is every row), the kept
        rows per chain (its last; a tree span's every row), and the spans (query starts, query lengths, key slots,
        masks): a chain's token at position p attends to positions 0..p of its table."""
        token_ids, positions, writes, starts, lengths, slots, masks, kept, counts = [], [], [], [], [], [], [], [], []
        for chain, start, table, *tree in chains:
            starts.append(len(token_ids))
            lengths.append(len(chain))
            token_ids += chain
            if tree and tree[0] is not None:
                rows = tree[0]
                end = max(rows.write_at) + 1
                positions += rows.positions
                writes += [slots_of(table, self.block_size, at, at + 1)[0] for at in rows.write_at]
                num_keys = padded_key_len(end)
                masks.append(self._tree_mask(rows, num_keys))
                kept += range(starts[-1], starts[-1] + len(chain))
                counts.append(len(chain))
            else:
                end = start + len(chain)
                positions += range(start, end)
                writes += slots_of(table, self.block_size, start, end)
                num_keys = padded_key_len(end)
                masks.append(self._mask(start, end, num_keys))
                kept.append(starts[-1] + len(chain) - 1)
                counts.append(1)
            slots.append(self._key_slots(table, end, num_keys))
        tokens, positions, writes = torch.tensor([token_ids, positions, writes])
        kept_rows = None if len(kept) == len(token_ids) else torch.tensor(kept)
        return tokens, positions, writes, kept_rows, counts, (starts, lengths, slots, masks)

    def _tree_mask(self, rows: TreeRows, num_keys: int) -> torch.Tensor:
        """[1, 1, rows, num_keys]: each row sees the real tokens and the table positions it names."""
        mask = self._key_indices(num_keys)[None].repeat(len(rows.sees), 1) < rows.context
        for row, seen in enumerate(rows.sees):
            mask[row, seen] = True
        return mask.view(1, 1, len(rows.sees), num_keys)

    def _key_slots(self, table: list[int], context: int, num_keys: int) -> torch.Tensor:
        key = (tuple(table[:-(-num_keys // self.block_size)]), num_keys)
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = key_slots(table, context, num_keys, self.block_size)
            _bound(self._slots)
        return slots

    def _key_indices(self, num_keys: int) -> torch.Tensor:
        """0 .. NUM_KEYS - 1: a view of one range, made anew only when a longer one is asked."""
        if len(self._indices) < num_keys:
            self._indices = torch.arange(2 * num_keys)
        return self._indices[:num_keys]

    def _mask(self, start: int, end: int, num_keys: int) -> torch.Tensor:
        """[1, 1, end - start, num_keys]: the row of position p sees keys 0..p. One row per query, not per query head:
        the row kernel reads the mask of a query's heads from the query's row."""
        keys = self._key_indices(num_keys)
        causal = keys < end if end - start == 1 else keys <= torch.arange(start, end)[:, None]
        return causal.view(1, 1, end - start, num_keys)


def _bound(kept: dict) -> None:
    if len(kept) > MAX_KEPT:
        kept.clear()
