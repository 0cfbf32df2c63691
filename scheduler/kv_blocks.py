"""Bookkeeping of the paged KV cache: which blocks of the shared pool hold which request's positions.

The engine owns the tensors; this module only decides. Block table entry i of a
request holds its positions [i * block_size, (i + 1) * block_size).

Placement keeps each request's blocks one contiguous run whenever the pool has
room: a new request starts in the middle of the largest free run (leaving its
neighbour room to grow too) and grows into the block after its last one. Attention
can then read such a request's keys and values in place instead of gathering its
blocks (engine/model/paged_attention.py); when the pool is fragmented a table simply
takes whichever blocks are free, and nothing but speed depends on contiguity.
"""
from __future__ import annotations


class KVBlockManager:
    """Block tables of requests over one pool; a block may be shared.

    A block is referenced by the request tables that contain it and by holders
    outside them (the session cache keeps a finished turn's blocks for the next
    turn); it is free once nothing references it. A request may start from shared
    blocks (`share`), whose positions it never writes: it only reads them and adds
    blocks of its own after them.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one position")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: set[int] = set(range(num_blocks))
        self._free_runs = FreeRuns(num_blocks)  # the same blocks as runs of consecutive ids, for placement
        self.block_tables: dict[str, list[int]] = {}  # request id -> [num blocks owned] block ids
        self._table_refs = [0] * num_blocks  # [num_blocks] request tables holding each block
        self._held_refs = [0] * num_blocks  # [num_blocks] holders outside the tables (cached sessions)
        self._num_in_tables = 0  # blocks held by at least one request table

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks that requests (running, or waiting with a reused prefix) hold."""
        return self._num_in_tables / self.num_blocks

    @property
    def num_held_only_blocks(self) -> int:
        """Blocks that only holders outside the tables keep: what evicting every cached session would free."""
        return self.num_blocks - len(self._free) - self._num_in_tables

    def blocks_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def num_new_blocks(self, request_id: str, num_positions: int) -> int:
        """Blocks the request must add so that its table covers `num_positions` positions."""
        owned = len(self.block_tables.get(request_id, ()))
        return max(self.blocks_needed(num_positions) - owned, 0)

    def positions_available(self, request_id: str) -> int:
        """Positions the request could cover with the blocks it owns plus every free block."""
        return (len(self.block_tables.get(request_id, ())) + len(self._free)) * self.block_size

    def can_grow(self, request_id: str, num_positions: int) -> bool:
        return self.num_new_blocks(request_id, num_positions) <= len(self._free)

    def grow_towards(self, request_id: str, num_positions: int) -> int:
        """Extend the request's table towards `num_positions` positions as far as the free blocks allow; returns the
        positions it covers."""
        self.grow(request_id, min(num_positions, self.positions_available(request_id)))
        return len(self.block_tables.get(request_id, ())) * self.block_size

    def grow(self, request_id: str, num_positions: int) -> list[int]:
        """Extend the request's table to cover `num_positions` positions; returns the table."""
        needed = self.num_new_blocks(request_id, num_positions)
        if needed > len(self._free):
            raise MemoryError(f"{request_id} needs {needed} KV blocks, {len(self._free)} are free")
        table = self.block_tables.setdefault(request_id, [])
        for taken in range(needed):
            if table and table[-1] + 1 in self._free:  # the request's run goes on (the free run starts there)
                block = run_start = table[-1] + 1
            else:  # room to grow: the middle of the largest free run, less the blocks about to be taken
                run_start, length = self._free_runs.largest()
                block = run_start + max(length - (needed - taken), 0) // 2
            self._free.remove(block)
            self._free_runs.remove(block, run_start)
            self._add_table_ref(block)
            table.append(block)
        return table

    def share(self, request_id: str, block_ids: list[int]) -> None:
        """Start the request's table with blocks already in use (a reused prefix)."""
        if request_id in self.block_tables:
            raise ValueError(f"{request_id} already has a block table")
        for block in block_ids:
            if block in self._free:
                raise ValueError(f"block {block} is free: only blocks in use can be shared")
            self._add_table_ref(block)
        self.block_tables[request_id] = list(block_ids)

    def hold(self, block_ids: list[int]) -> None:
        """Keep blocks in use outside any request table, until `release`."""
        for block in block_ids:
            if block in self._free:
                raise ValueError(f"block {block} is free: only blocks in use can be held")
            self._held_refs[block] += 1

    def release(self, block_ids: list[int]) -> None:
        for block in block_ids:
            self._held_refs[block] -= 1
            self._free_if_unused(block)

    def shrink(self, request_id: str, num_positions: int) -> None:
        """Release the blocks past `num_positions` positions (rejected drafts, rollback)."""
        table = self.block_tables.get(request_id, [])
        keep = self.blocks_needed(num_positions)
        for block in table[keep:]:
            self._drop_table_ref(block)
        del table[keep:]

    def free(self, request_id: str) -> None:
        for block in self.block_tables.pop(request_id, ()):
            self._drop_table_ref(block)

    def _add_table_ref(self, block: int) -> None:
        self._table_refs[block] += 1
        self._num_in_tables += self._table_refs[block] == 1

    def _drop_table_ref(self, block: int) -> None:
        self._table_refs[block] -= 1
        self._num_in_tables -= self._table_refs[block] == 0
        self._free_if_unused(block)

    def _free_if_unused(self, block: int) -> None:
        if self._table_refs[block] == 0 and self._held_refs[block] == 0:
            self._free.add(block)
            self._free_runs.add(block)

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


class FreeRuns:
    """Free blocks as maximal runs of consecutive ids; each change costs O(1), finding the largest O(number of runs)."""

    def __init__(self, num_blocks: int) -> None:
        self.length_by_start: dict[int, int] = {0: num_blocks}  # first block of a run -> its length
        self.start_by_end: dict[int, int] = {num_blocks - 1: 0}  # last block of a run -> its first

    def largest(self) -> tuple[int, int]:
        """(first block, length) of the longest run."""
        return max(self.length_by_start.items(), key=lambda run: run[1])

    def add(self, block: int) -> None:
        """A block comes free: it joins the runs that end just before it and start just after it."""
        start = self.start_by_end.pop(block - 1, block)
        end = block + self.length_by_start.pop(block + 1, 0)
        self.length_by_start[start] = end - start + 1
        self.start_by_end[end] = start

    def remove(self, block: int, run_start: int) -> None:
        """A block of the run starting at `run_start` is taken: what is left either side stays free."""
        end = run_start + self.length_by_start.pop(run_start) - 1
        del self.start_by_end[end]
        if block > run_start:
            self.length_by_start[run_start] = block - run_start
            self.start_by_end[block - 1] = run_start
        if block < end:
            self.length_by_start[block + 1] = end - block
            self.start_by_end[end] = block + 1
