"""Bookkeeping of the paged KV cache: which blocks of the shared pool hold which request's positions.

The engine owns the tensors; this module only decides. Block table entry i of a
request holds its positions [i * block_size, (i + 1) * block_size).

Placement keeps each request's blocks one contiguous run whenever the pool has
room: a new request starts in the middle of the largest free run (leaving its
neighbour room to grow too) and grows into the block after its last one. Attention
can then read such a request's keys and values in place instead of gathering its
blocks (engine/paged_attention.py); when the pool is fragmented a table simply
takes whichever blocks are free, and nothing but speed depends on contiguity.
"""
from __future__ import annotations


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one position")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: set[int] = set(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}  # request id -> [num blocks owned] block ids

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def num_new_blocks(self, request_id: str, num_positions: int) -> int:
        """Blocks the request must add so that its table covers `num_positions` positions."""
        owned = len(self.block_tables.get(request_id, ()))
        return max(self.blocks_needed(num_positions) - owned, 0)

    def can_grow(self, request_id: str, num_positions: int) -> bool:
        return self.num_new_blocks(request_id, num_positions) <= len(self._free)

    def grow(self, request_id: str, num_positions: int) -> list[int]:
        """Extend the request's table to cover `num_positions` positions; returns the table."""
        needed = self.num_new_blocks(request_id, num_positions)
        if needed > len(self._free):
            raise MemoryError(f"{request_id} needs {needed} KV blocks, {len(self._free)} are free")
        table = self.block_tables.setdefault(request_id, [])
        for taken in range(needed):
            block = table[-1] + 1 if table else None
            if block not in self._free:
                block = self._roomiest_start(needed - taken)
            self._free.remove(block)
            table.append(block)
        return table

    def _roomiest_start(self, num_blocks: int) -> int:
        """A free block with room after it: the middle of the largest free run, less the blocks about to be taken."""
        start, length = _largest_run(sorted(self._free))
        return start + max(length - num_blocks, 0) // 2

    def shrink(self, request_id: str, num_positions: int) -> None:
        """Release the blocks past `num_positions` positions (rejected drafts, rollback)."""
        table = self.block_tables.get(request_id, [])
        keep = self.blocks_needed(num_positions)
        self._free.update(table[keep:])
        del table[keep:]

    def free(self, request_id: str) -> None:
        self._free.update(self.block_tables.pop(request_id, ()))

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """[end - start] flat pool slots of positions start..end-1 of the request."""
        table, size = self.block_tables[request_id], self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def contiguous_first_slot(self, request_id: str, num_positions: int) -> int | None:
        """The pool slot of position 0 when the request's first `num_positions` positions lie in one run of slots."""
        table = self.block_tables[request_id][:self.blocks_needed(num_positions)]
        if any(b != a + 1 for a, b in zip(table, table[1:])):
            return None
        return table[0] * self.block_size


def _largest_run(sorted_blocks: list[int]) -> tuple[int, int]:
    """(first block, length) of the longest run of consecutive ids in a non-empty sorted list."""
    best_start, best_len, start = sorted_blocks[0], 0, sorted_blocks[0]
    for prev, block in zip(sorted_blocks, sorted_blocks[1:] + [None]):
        if block != prev + 1:
            if prev - start + 1 > best_len:
                best_start, best_len = start, prev - start + 1
            start = block
    return best_start, best_len
