import pytest

from scheduler.kv_blocks import KVBlockManager


def test_grow_shrink_and_free_return_every_block():
    manager = KVBlockManager(num_blocks=4, block_size=4)
    assert manager.grow("a", 5) == [0, 1]
    assert manager.grow("b", 4) == [2]
    assert manager.grow("a", 8) == [0, 1]  # already covered
    assert manager.usage == pytest.approx(0.75)
    manager.shrink("a", 3)  # rollback: keeps one block
    assert manager.block_tables["a"] == [0] and manager.num_free_blocks == 2
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


def test_slots_follow_the_block_table():
    manager = KVBlockManager(num_blocks=4, block_size=3)
    manager.grow("x", 2)
    manager.grow("y", 3)
    manager.grow("x", 5)  # x owns blocks 0 and 2
    assert manager.slots("x", 0, 5) == [0, 1, 2, 6, 7]
    assert manager.slots("y", 1, 3) == [4, 5]
