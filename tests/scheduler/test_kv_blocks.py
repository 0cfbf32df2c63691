import pytest

from scheduler.kv_blocks import KVBlockManager


def test_grow_shrink_and_free_return_every_block():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    a = list(manager.grow("a", 5))
    b = list(manager.grow("b", 4))
    assert len(a) == 2 and len(b) == 1 and not set(a) & set(b)
    assert manager.grow("a", 8) == a  # already covered
    assert manager.usage == pytest.approx(0.75)
    manager.shrink("a", 3)  # rollback: keeps one block
    assert manager.block_tables["a"] == a[:1] and manager.num_free_blocks == 2
    manager.free("a")
    manager.free("b")
    manager.free("never-seen")
    assert manager.num_free_blocks == 4 and manager.usage == 0.0


def test_a_full_pool_refuses_without_changing_anything():
    manager = KVBlockManager(num_blocks=2, block_size=2)
    manager.grow("a", 3)
    assert not manager.can_grow("b", 1)
    with pytest.raises(MemoryError):
        manager.grow("b", 1)
    assert manager.block_tables == {"a": [0, 1]}


def test_growing_towards_a_length_takes_what_is_free_and_says_what_it_covers():
    manager = KVBlockManager(num_blocks=3, block_size=4)
    assert manager.grow_towards("a", 5) == 8  # two blocks
    assert manager.grow_towards("a", 3) == 8  # covered already: nothing taken, nothing given back
    assert manager.grow_towards("a", 40) == 12 and manager.num_free_blocks == 0  # as far as the pool allows


def test_slots_follow_the_block_table():
    manager = KVBlockManager(num_blocks=4, block_size=3)
    manager.block_tables["x"] = [0, 2]
    assert manager.slots("x", 0, 5) == [0, 1, 2, 6, 7]
    assert manager.slots("x", 4, 6) == [7, 8]


def test_requests_are_placed_apart_so_that_each_grows_into_one_contiguous_run():
    manager = KVBlockManager(num_blocks=400, block_size=4)  # room: 4 requests use 60 blocks
    for step in range(1, 21):  # four requests grow side by side, one position each per step
        for name in "abcd":
            manager.grow(name, 40 + step)
    for name in "abcd":
        table = manager.block_tables[name]
        assert table == list(range(table[0], table[0] + 15))
        assert manager.contiguous_first_slot(name, 60) == table[0] * 4


def test_a_fragmented_pool_still_serves_every_block_and_says_when_a_table_is_not_contiguous():
    manager = KVBlockManager(num_blocks=6, block_size=1)
    for name in "abcdef":
        manager.grow(name, 1)
    for name in "ace":
        manager.free(name)
    assert manager.grow("g", 3) and manager.num_free_blocks == 0
    assert manager.contiguous_first_slot("g", 3) is None
    assert manager.contiguous_first_slot("g", 1) == manager.block_tables["g"][0]


def test_shared_and_held_blocks_are_freed_only_when_nothing_references_them():
    manager = KVBlockManager(num_blocks=8, block_size=4)
    first = list(manager.grow("turn-1", 12))  # 3 blocks
    manager.hold(first[:2])  # a session keeps the 2 full blocks of history
    manager.free("turn-1")
    assert manager.num_free_blocks == 6 and manager.usage == 0 and manager.num_held_only_blocks == 2
    manager.share("turn-2", first[:2])  # the next turn reads them
    manager.grow("turn-2", 14)
    assert manager.block_tables["turn-2"][:2] == first[:2] and len(manager.block_tables["turn-2"]) == 4
    assert manager.usage == 0.5 and manager.num_held_only_blocks == 0
    manager.release(first[:2])  # the session goes: turn-2 still reads its prefix
    assert manager.num_free_blocks == 4
    manager.shrink("turn-2", 8)  # rollback never reaches below what it shares here; the blocks after go
    assert manager.num_free_blocks == 6
    manager.free("turn-2")
    assert manager.num_free_blocks == 8 and manager.usage == 0


def test_only_blocks_in_use_can_be_shared_or_held():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="free"):
        manager.share("r", [0])
    with pytest.raises(ValueError, match="free"):
        manager.hold([1])
    manager.grow("r", 4)
    with pytest.raises(ValueError, match="already"):
        manager.share("r", manager.block_tables["r"])


def runs_of(blocks: set[int]) -> dict[int, int]:
    """{first block: length} of the maximal runs of consecutive ids in BLOCKS."""
    runs = {}
    for block in sorted(blocks):
        if block - 1 not in blocks:
            length = 1
            while block + length in blocks:
                length += 1
            runs[block] = length
    return runs


def test_free_runs_follow_every_grow_shrink_hold_and_free():
    import random

    rng = random.Random(0)
    manager = KVBlockManager(num_blocks=64, block_size=2)
    for step in range(2000):
        name = f"r{rng.randrange(8)}"
        action = rng.random()
        if action < 0.5 and manager.can_grow(name, 2 * len(manager.block_tables.get(name, ())) + 3):
            manager.grow(name, 2 * len(manager.block_tables.get(name, ())) + 3)
        elif action < 0.7 and name in manager.block_tables:
            manager.shrink(name, rng.randrange(2 * len(manager.block_tables[name]) + 1))
        elif action < 0.8 and manager.block_tables.get(name):
            manager.hold(manager.block_tables[name][:1])
            manager.free(name)
            manager.release([b for b in range(64) if manager._held_refs[b]][:1])
        else:
            manager.free(name)
        assert manager._free_runs.length_by_start == runs_of(manager._free), step
        assert ({end: start for start, end in ((s, s + n - 1) for s, n in runs_of(manager._free).items())}
                == manager._free_runs.start_by_end)
