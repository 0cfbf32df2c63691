"""Sliding-window attention through the paged pool: a small Gemma-3-shaped model, whose local layers see the last
WINDOW positions and whose global layer sees all, served by the packed runner gives the logits (and the attention
rows) of transformers' own eager forward at contexts shorter and several times longer than the window: decoding
beside another request, verifying trees of drafts (look-ahead rows and a tree deeper than the window among them),
prefilling in chunks. On the CPU row kernel and on the batched-matmul path, read in place or gathered, through
whichever forward the runner chooses for the model and through transformers' own."""
import copy
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

import engine.model.paged_attention as paged_attention
from drafters.base import CaptureSpec
from engine.model.forward import ForwardBatch, chain_item, tree_item
from engine.model.packed_runner import PackedModelRunner
from engine.model.paged_attention import PagedKVPool, kv_shape
from scheduler.kv_blocks import KVBlockManager

WINDOW = 8
BLOCK_SIZE = 4
NUM_BLOCKS = 64
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


def gemma_config(layer_types: list[str] = LAYER_TYPES) -> Gemma3TextConfig:
    return Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=WINDOW, layer_types=layer_types, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.2,  # sharper logits than the default's: greedy picks stand far from ties
    )


@pytest.fixture(scope="module")
def reference():
    """transformers' Gemma 3 with its eager attention, which masks the local layers to the window itself."""
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(gemma_config(), attn_implementation="eager").eval()


RUNNERS = list(itertools.product(["row-kernel", "matmuls"], ["all-gathered", "in-place"], ["chosen", "transformers"]))


@pytest.fixture(params=RUNNERS, ids=["-".join(p) for p in RUNNERS])
def runner(request, reference, monkeypatch) -> PackedModelRunner:
    """The runner over a copy of the reference's weights. row-kernel/matmuls: which CPU attention computes (the
    matmuls are the path of CPUs without the kernel); all-gathered/in-place: whether sequences with contiguous slots
    are read in place; chosen/transformers: the runner's own choice of forward (the lean decoder where it supports
    the model) or transformers' forward through the attention interface."""
    attention, path, forward = request.param
    if attention == "matmuls":
        monkeypatch.setattr(paged_attention, "_row_kernel_runs", lambda: False)
    elif not paged_attention._row_kernel_runs():
        pytest.skip("the row attention kernel needs AVX-512F or AVX2 with FMA and a C++ compiler")
    model = copy.deepcopy(reference)
    num_layers, kv_heads, head_dim = kv_shape(model.config)
    pool = PagedKVPool(num_layers, NUM_BLOCKS * BLOCK_SIZE, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    runner = PackedModelRunner(
        model, torch.device("cpu"), pool, BLOCK_SIZE, in_place_min_context=10**9 if path == "all-gathered" else 1
    )
    if forward == "transformers":
        runner.decoder = None
    return runner


def plain_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] logits of one plain forward."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([token_ids])).logits[0]


def sequence(length: int, seed: int) -> list[int]:
    return [1] + [(seed * i + 5) % 120 + 3 for i in range(length - 1)]


def test_the_window_changes_the_logits_at_these_contexts(reference):
    """The other tests would pass without a window if it changed nothing: past it, the local layers see less."""
    tokens = sequence(40, seed=7)
    config = gemma_config()
    config.sliding_window = 10**6  # the same layers, each with its own rotary, but none windowed
    unwindowed = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    unwindowed.load_state_dict(reference.state_dict())
    windowed, full = plain_logits(reference, tokens), plain_logits(unwindowed, tokens)
    torch.testing.assert_close(windowed[:WINDOW], full[:WINDOW], **TOLERANCE)
    assert (windowed[3 * WINDOW:] - full[3 * WINDOW:]).abs().max() > 0.1


def test_greedy_decoding_beside_another_request_continues_as_transformers_does(reference, runner):
    """Two requests, one prompt shorter than the window and one longer, prefilled together, then decoded together
    token by token to five and six windows: every step's logits are those of a plain forward over the whole
    sequence, and so is every greedy pick."""
    blocks = KVBlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    tokens = {"short": sequence(5, seed=11), "long": sequence(20, seed=13)}
    new = dict(tokens)
    done = {name: 0 for name in tokens}
    for _ in range(30):
        items = [
            chain_item(new[name], done[name], blocks.grow(name, len(tokens[name])), BLOCK_SIZE)
            for name in tokens
        ]
        for name, logits in zip(tokens, runner.execute(ForwardBatch(items)).logits):
            expected = plain_logits(reference, tokens[name])[-1]
            torch.testing.assert_close(logits[0], expected, **TOLERANCE)
            assert int(logits[0].argmax()) == int(expected.argmax())
            done[name] = len(tokens[name])
            new[name] = [int(logits[0].argmax())]
            tokens[name].append(new[name][0])
    assert len(tokens["short"]) > 4 * WINDOW and len(tokens["long"]) > 6 * WINDOW


# A tree after the context: row 0 (the last real token), branches 0-1-2-3 and 0-4-5, a third 0-1-6, and a
# look-ahead branch 7-8 that continues the cached context (drafter rows)
TREE_PARENTS = [-1, 0, 1, 2, 0, 4, 1, -1, 7]
# A tree deeper than the window: a trunk of 12 nodes (rows 0-11), a branch of 9 off its second node (rows 12-20, so
# far after their positions in KV order that KV indices would keep the branch's first nodes in its last's window),
# and one node off its tenth
DEEP_PARENTS = [-1] + list(range(11)) + [1] + list(range(12, 20)) + [9]


def leaf_paths(parents: list[int]) -> list[list[int]]:
    """Each leaf's path of rows, root first."""
    has_child = {parent for parent in parents if parent >= 0}
    paths = []
    for leaf in (row for row in range(len(parents)) if row not in has_child):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


@pytest.mark.parametrize("parents", [TREE_PARENTS, DEEP_PARENTS], ids=["tree", "deeper-than-the-window"])
def test_a_tree_gets_the_logits_of_its_paths_drafted_as_chains(reference, runner, parents):
    """Every node of a tree verified after a context of several windows gets the logits its path gets drafted as a
    chain after the same context, and those of a plain forward over the context and the path."""
    blocks = KVBlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    context = sequence(30, seed=17)
    nodes = [(37 * row + 9) % 120 + 3 for row in range(len(parents))]
    runner.execute(ForwardBatch([chain_item(context, 0, blocks.grow("tree", len(context)), BLOCK_SIZE)]))
    tree = tree_item(
        nodes, parents, len(context), blocks.grow("tree", len(context) + len(nodes)), BLOCK_SIZE,
        logit_rows=list(range(len(nodes))),
    )
    tree_logits = runner.execute(ForwardBatch([tree])).logits[0]
    for i, path in enumerate(leaf_paths(parents)):
        name = f"chain-{i}"
        runner.execute(ForwardBatch([chain_item(context, 0, blocks.grow(name, len(context)), BLOCK_SIZE)]))
        drafted = chain_item(
            [nodes[row] for row in path], len(context), blocks.grow(name, len(context) + len(path)), BLOCK_SIZE,
            num_logits=len(path),
        )
        chain_logits = runner.execute(ForwardBatch([drafted])).logits[0]
        plain = plain_logits(reference, context + [nodes[row] for row in path])[len(context):]
        torch.testing.assert_close(tree_logits[path], chain_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tree_logits[path], plain, **TOLERANCE)
        blocks.free(name)


def test_a_prefill_in_chunks_gives_the_logits_of_one_prefill(reference, runner):
    """Chunks of a prompt several windows long, shorter and longer than the window, each attending to the cached
    chunks before it: every position's logits are those of one prefill of the whole prompt, and of transformers."""
    blocks = KVBlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    tokens = sequence(44, seed=19)

    def prefill(name: str, chunks: list[int]) -> torch.Tensor:
        done, rows = 0, []
        for n in chunks:
            item = chain_item(tokens[done:done + n], done, blocks.grow(name, done + n), BLOCK_SIZE, num_logits=n)
            rows.append(runner.execute(ForwardBatch([item])).logits[0])
            done += n
        return torch.cat(rows)

    whole = prefill("whole", [len(tokens)])
    torch.testing.assert_close(whole, plain_logits(reference, tokens), **TOLERANCE)
    torch.testing.assert_close(prefill("chunks", [3, 9, 1, 17, 14]), whole, rtol=1e-5, atol=1e-5)


def test_captured_attention_rows_are_those_of_transformers_within_each_layers_window(reference, runner):
    """A drafter's attention rows of a local layer's heads are zero outside the window and transformers' inside it;
    the global layer's span the whole context; for a chain and for a tree's node alike."""
    blocks = KVBlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    context = sequence(30, seed=23)
    capture = CaptureSpec(attention_heads=((0, 1), (2, 0), (3, 0)))
    first = chain_item(context[:26], 0, blocks.grow("s", 26), BLOCK_SIZE)
    first.attention_rows = [25]
    # rows 0-3 continue the context; row 4 branches off row 1
    second = tree_item(context[26:] + [11], [-1, 0, 1, 2, 1], 26, blocks.grow("s", 31), BLOCK_SIZE, [3, 4])
    second.attention_rows = [3, 4]
    got_first = runner.execute(ForwardBatch([first], capture)).attention[0]
    got_second = runner.execute(ForwardBatch([second], capture)).attention[0]
    with torch.inference_mode():
        plain = reference(input_ids=torch.tensor([context]), output_attentions=True).attentions
        branch = reference(input_ids=torch.tensor([context[:28] + [11]]), output_attentions=True).attentions

    def rows(attentions, position: int) -> torch.Tensor:  # [capture heads, keys] of a plain forward
        return torch.stack([attentions[layer][0, head, position] for layer, head in capture.attention_heads])

    torch.testing.assert_close(got_first[0], rows(plain, 25)[:, :26], rtol=1e-4, atol=1e-5)
    assert (got_first[0][0, :26 - WINDOW] == 0).all() and (got_first[0][1, :26 - WINDOW] > 0).all()
    path = got_second[0]  # keys in KV order: the 26 cached, rows 0 to 3 (its path), 4 (not its)
    torch.testing.assert_close(path[:, :30], rows(plain, 29), rtol=1e-4, atol=1e-5)
    assert (path[:, 30] == 0).all()
    sibling = got_second[1]  # keys in KV order: the 26 cached, rows 0, 1, 2 and 3 (not its), 4 (itself)
    expected = rows(branch, 28)
    torch.testing.assert_close(sibling[:, :28], expected[:, :28], rtol=1e-4, atol=1e-5)
    assert (sibling[:, 28:30] == 0).all()
    torch.testing.assert_close(sibling[:, 30], expected[:, 28], rtol=1e-4, atol=1e-5)
