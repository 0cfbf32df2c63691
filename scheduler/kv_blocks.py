"""Bookkeeping of the paged KV cache: which blocks of the shared pool hold which request's positions.

The engine owns the tensors; this module only decides. Block table entry i of a
request holds its positions [i * block_size, (i + 1) * block_size).
"""
from __future__ import annotations

from collections import deque


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one position")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
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
        table.extend(self._free.popleft() for _ in range(needed))
        return table

    def shrink(self, request_id: str, num_positions: int) -> None:
        """Release the blocks past `num_positions` positions (rejected drafts, rollback)."""
        table = self.block_tables.get(request_id, [])
        keep = self.blocks_needed(num_positions)
        self._free.extend(table[keep:])
        del table[keep:]

    def free(self, request_id: str) -> None:
        self._free.extend(self.block_tables.pop(request_id, ()))

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """[end - start] flat pool slots of positions start..end-1 of the request."""
        table, size = self.block_tables[request_id], self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]
