"""The CPU attention path of machines without the row kernel (AVX2): batched matmuls whose rows come out bit for
bit the same whatever the padding keys after them. The masks a layer with a sliding window attends under."""
from types import SimpleNamespace

import pytest
import torch

import engine.model.paged_attention as paged_attention
from engine.model.attention_layout import (
    KEY_MULTIPLE,
    GroupMember,
    ancestor_matrix,
    build_group,
    member_positions,
    tree_paths,
    windowed_mask,
)


@pytest.mark.parametrize("num_keys", [448, 512, 1024])
def test_a_rows_attention_ignores_how_many_padding_keys_follow_its_own(num_keys):
    """A query sees keys 0..376; the call pads the keys to 384 or to NUM_KEYS. Above 384 keys MKL's float32 GEMM on
    some CPUs groups its sum over the keys differently, so one product over all keys would move the row's last
    bits; summing KEY_MULTIPLE keys per product keeps them."""
    torch.manual_seed(7)
    rows, visible, head_dim = 8, 377, 64
    q = torch.randn(2, 3, rows, head_dim)  # [R, kv_heads, rows, head_dim]
    k, v = torch.randn(2, 3, num_keys, head_dim), torch.randn(2, 3, num_keys, head_dim)
    blocked = torch.zeros(2, 1, rows, num_keys, dtype=torch.bool)
    blocked[..., visible:] = True

    def attend(length: int) -> torch.Tensor:
        return paged_attention._row_invariant_attention(
            q, k[:, :, :length], v[:, :, :length], blocked[..., :length], head_dim**-0.5
        )

    assert 384 % KEY_MULTIPLE == 0 and torch.equal(attend(384), attend(num_keys))


def test_a_sliding_window_hides_the_keys_a_window_back_from_each_querys_position_made_once_per_window():
    """A chain and a tree attended in place share a call: each row keeps the keys of its full mask whose positions
    are above its query's minus the window, a tree's nodes at their depths' positions, whatever their KV indices;
    padding rows keep theirs. The narrowed mask is made once per window and reused; a window no query outgrows
    leaves the full mask."""
    chain = GroupMember(0, 3, 40, [0] * 10, positions=[37, 38, 39])
    # cached 26; rows 0-1-2 a branch, row 3 a sibling of row 1: positions 26, 27, 28, 27 at KV indices 26 to 29
    tree = GroupMember(3, 4, 30, [0] * 10, ancestors=ancestor_matrix([-1, 0, 1, 0]), positions=[26, 27, 28, 27])
    group = build_group([chain, tree], block_size=4, heads_per_kv_head=2, device=torch.device("cpu"))
    window = 8
    narrowed = windowed_mask(group.mask, group.positions, window)
    assert windowed_mask(group.mask, group.positions, window) is narrowed
    assert windowed_mask(group.mask, group.positions, 40) is group.mask  # the latest query is at 39

    def seen(r: int, row: int) -> list[int]:
        assert torch.equal(narrowed[r, 0, row], narrowed[r, 0, 4 + row])  # the second query head's copy
        return narrowed[r, 0, row].nonzero().flatten().tolist()

    assert seen(0, 2) == list(range(32, 40)) and seen(0, 0) == list(range(30, 38))
    assert seen(1, 2) == [21, 22, 23, 24, 25, 26, 27, 28]
    assert seen(1, 3) == [20, 21, 22, 23, 24, 25, 26, 29]
    assert torch.equal(narrowed[0, 0, 3], group.mask[0, 0, 3])  # the chain's padding row


def test_tree_paths_keep_the_positions_of_their_nodes():
    tree = GroupMember(0, 4, 30, [0] * 10, positions=[26, 27, 28, 27])
    paths = tree_paths(tree, [-1, 0, 1, 0], slots=[100, 101, 102, 103])
    assert [p.positions for p in paths] == [[26, 27, 28], [26, 27]]
    queries, keys = member_positions(paths[1], 32)
    assert queries.tolist() == [27] and keys[26:28].tolist() == [26, 27] and keys[29] == 29


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_pool_starts_zeroed_aligned_and_takes_writes(dtype):
    """The pool's CPU memory comes zeroed from the OS page by page (engine/model/paged_attention.py's _zeros): it must
    read as zeros, be aligned like torch's own, lie head by head, and hold what is written to it."""
    pool = paged_attention.PagedKVPool(3, 4096, 2, 64, dtype, torch.device("cpu"))
    for tensor in (pool.keys, pool.values):
        assert tensor.dtype == dtype and tensor.shape == (3, 4096, 2, 64) and tensor.transpose(1, 2).is_contiguous()
        assert tensor.data_ptr() % 64 == 0 and not tensor.any()
    key, value = torch.randn(2, 2, 64).to(dtype), torch.randn(2, 2, 64).to(dtype)
    pool.write(1, key, value, torch.tensor([7, 4000]))
    assert torch.equal(pool.keys[1, 7], key[0]) and torch.equal(pool.values[1, 4000], value[1])
    assert not pool.keys[0].any() and not pool.keys[2].any()


@pytest.mark.parametrize("kv_heads", [1, 3])
def test_blocks_gather_the_same_from_a_head_major_pool_as_from_a_slot_major_one(kv_heads):
    """The CPU pool lies head by head (PagedKVPool); the gathered path (machines without the row kernel, captures)
    copies whole blocks either way and must return the same keys by slot, tree nodes' keys put in their places."""
    torch.manual_seed(3)
    num_slots, block_size, head_dim = 64, 4, 8
    pool = paged_attention.PagedKVPool(1, num_slots, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    assert kv_heads == 1 or paged_attention._head_major(pool.layer_keys[0])
    pool.layer_keys[0].copy_(torch.randn(num_slots, kv_heads, head_dim))
    slot_major = pool.layer_keys[0].contiguous()
    assert not paged_attention._head_major(slot_major)
    table = torch.tensor([[5, 2, 9], [0, 14, 7]])
    group = SimpleNamespace(block_table=table, block_size=block_size, max_len=10,
                            tail_slots=torch.tensor([60, 61]), tail_keys=torch.tensor([8, 12 + 9]))

    def gathered(layer_pool: torch.Tensor) -> torch.Tensor:
        into = torch.empty(table.numel(), block_size * kv_heads * head_dim)
        return paged_attention._gather_group(layer_pool, group, into)

    expected = torch.stack([slot_major[torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in row])]
                            for row in table.tolist()])[:, :10]
    expected[0, 8], expected[1, 9] = slot_major[60], slot_major[61]
    for layer_pool in (pool.layer_keys[0], slot_major):
        assert torch.equal(gathered(layer_pool), expected)
        assert torch.equal(paged_attention._gather_blocks(layer_pool, table, block_size, 10)[0, :8], expected[0, :8])
