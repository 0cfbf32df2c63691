"""The Triton paged attention for chains and small trees (on a CPU through Triton's interpreter): each row attends its
own sequence's cached keys where its block table puts them, within the layer's window, and of the step's new keys its
tree ancestors and itself, for grouped-query heads, chains longer than the ancestor bits included; with trees and
prefill chunks (one past the kernel's chain limit) in the same steps, the runner's logits equal the SDPA backend's."""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model.attention_layout import ancestor_masks, paged_rows
from engine.model.forward import ForwardBatch, chain_item, tree_item
from engine.model.packed_runner import PackedModelRunner
from engine.model.paged_attention import PagedKVPool, triton_available
from scheduler.kv_blocks import KVBlockManager

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # on a CPU: Triton's interpreter
pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="needs the triton package (a test dependency)")
BLOCK_SIZE = 4


def reference(query, keys, values, items, starts, scale, window):
    """Each row's softmax(q k^T * scale) v over the entries it sees: of its sequence's cached ones and the step's new
    ones (its ancestors and itself), those within the last WINDOW entries up to its own position."""
    out = torch.zeros_like(query)
    group = query.shape[1] // keys.shape[1]
    for item, start in zip(items, starts):
        slots = [item.block_table[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(item.context_len)]
        k, v = keys[slots].double(), values[slots].double()
        for row, mask in enumerate(ancestor_masks(item.parents, item.num_tokens)):
            low = max(0, item.positions[row] - window + 1) if window else 0
            seen = [i for i in range(low, item.num_cached)] + [
                item.num_cached + j for j in range(item.num_tokens) if mask >> j & 1 and item.num_cached + j >= low]
            for head in range(query.shape[1]):
                scores = query[start + row, head].double() @ k[seen, head // group].T * scale
                out[start + row, head] = (torch.softmax(scores, -1) @ v[seen, head // group]).float()
    return out


def attends_like_the_reference(seed, heads, kv_heads, head_dim, num_blocks, make_items, scale, window):
    """The kernel over the items MAKE_ITEMS(order) builds on random keys and values in NUM_BLOCKS blocks scattered
    through the pool (ORDER: a random permutation of them), packed one after another, equals `reference`."""
    from engine.model import triton_attention

    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim, generator=generator).to(DEVICE)
                    for _ in range(2))
    items = make_items(torch.randperm(num_blocks, generator=generator).tolist())
    starts = list(itertools.accumulate((item.num_tokens for item in items), initial=0))
    query = torch.randn(starts.pop(), heads, head_dim, generator=generator).to(DEVICE)
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_rows_attention(query, keys, values, paged_rows(list(zip(starts, items)), BLOCK_SIZE,
                                          query.device), scale, window, out, BLOCK_SIZE)
    expected = reference(query.cpu(), keys.cpu(), values.cpu(), items, starts, scale, window)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("processors", [8, 64], ids=["one-pass", "split"])  # 16 rows x 2 KV heads: 2 splits
@pytest.mark.parametrize("window", [None, 9])
def test_rows_attend_what_they_see_wherever_their_blocks_lie(window, processors, monkeypatch):
    from engine.model import triton_attention

    monkeypatch.setattr(triton_attention, "INTERPRETER_PROCESSORS", processors)
    attends_like_the_reference(3, 6, 2, 24, 40, lambda order: [  # head_dim 24, not a power of two: masked lanes
        chain_item([0], 36, order[:10], BLOCK_SIZE), chain_item([0] * 4, 66, order[10:28], BLOCK_SIZE, 4),
        tree_item([0] * 5, [-1, 0, 0, -1, 1], 30, order[28:37], BLOCK_SIZE, [0, 1, 2, 3, 4]),
        chain_item([0] * 2, 0, order[37:38], BLOCK_SIZE, 2)], 0.2, window)  # the last: nothing cached


@pytest.mark.parametrize("window", [None, 9, 100])
def test_a_chain_longer_than_the_ancestor_bits_equals_the_reference(window):
    """A prefill chunk of 150 tokens after 20 cached ones, beside a decoding row: its rows past the first 64 count the
    earlier ones as cached, within any window."""
    attends_like_the_reference(5, 4, 2, 16, 60, lambda order: [
        chain_item([0], 12, order[:4], BLOCK_SIZE), chain_item([0] * 150, 20, order[4:47], BLOCK_SIZE, 150)],
        0.3, window)


@pytest.mark.parametrize("window", [None, 150])
def test_a_long_row_split_over_its_keys_equals_the_reference(window, monkeypatch):
    """Rows of a few hundred keys spread over every split (some empty, some before the window) and are recombined;
    on a CPU too with as many splits as on a GPU."""
    from engine.model import triton_attention

    monkeypatch.setattr(triton_attention, "INTERPRETER_PROCESSORS", 1024)  # 4 rows: 16 splits, as at batch 1 on a GPU
    assert triton_attention.num_splits(4, 1, torch.device("cpu")) == triton_attention.MAX_SPLITS
    attends_like_the_reference(4, 4, 1, 16, 180, lambda order: [
        chain_item([0] * 3, 500, order[:126], BLOCK_SIZE, 3), chain_item([0], 200, order[126:177], BLOCK_SIZE)],
        0.2, window)


@pytest.mark.parametrize("max_chain_len", [512, 16], ids=["prefill-in-kernel", "prefill-in-sdpa"])
def test_the_triton_backend_gives_the_sdpa_backends_logits_beside_a_tree_and_a_prefill(
    tiny_model_dir, max_chain_len, monkeypatch
):
    """The 38-token prefill chunk goes through the Triton kernel, or (past a chain limit of 16) through SDPA beside
    the kernel's rows in the same step."""
    from engine.model import packed_runner

    monkeypatch.setattr(packed_runner, "TRITON_MAX_CHAIN_LEN", max_chain_len)
    logits = {}
    for backend in ("sdpa", "triton"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(DEVICE).eval()
        config = model.config
        head_dim = config.hidden_size // config.num_attention_heads
        pool = PagedKVPool(config.num_hidden_layers, 64 * BLOCK_SIZE, config.num_key_value_heads, head_dim,
                           torch.float32, DEVICE)
        runner = PackedModelRunner(model, DEVICE, pool, BLOCK_SIZE, backend, in_place_min_context=10**9)
        blocks = KVBlockManager(num_blocks=64, block_size=BLOCK_SIZE)
        a, b, c = [1] + list(range(3, 40)), [1, 30, 31], [1, 7, 9, 11]
        first = runner.execute(ForwardBatch([
            chain_item(a, 0, blocks.grow("a", len(a)), BLOCK_SIZE),
            chain_item(b, 0, blocks.grow("b", len(b)), BLOCK_SIZE),
            chain_item(c, 0, blocks.grow("c", len(c)), BLOCK_SIZE),
        ])).logits
        second = runner.execute(ForwardBatch([
            chain_item([4, 8, 12], len(a), blocks.grow("a", len(a) + 3), BLOCK_SIZE, 3),
            tree_item([5, 6, 7], [-1, 0, -1], len(b), blocks.grow("b", len(b) + 3), BLOCK_SIZE, [0, 1, 2]),
            chain_item([13], len(c), blocks.grow("c", len(c) + 1), BLOCK_SIZE),
        ])).logits
        logits[backend] = first + second
    for sdpa, triton in zip(logits["sdpa"], logits["triton"]):
        torch.testing.assert_close(triton, sdpa, rtol=1e-4, atol=1e-4)  # on a GPU: different float32 kernels
