"""A packed, ragged forward over the paged pool gives each sequence the logits of its own plain forward:
chains through prefill, drafts and rollback; trees, whose every node sees its own path only; look-ahead rows;
and the captures drafters ask for (hidden states, attention rows)."""
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from drafters.base import CaptureSpec
from engine.model.forward import ForwardBatch, ForwardItem, RowChoice, chain_item, slots_of, tree_item
from engine.model.packed_runner import PackedModelRunner
from engine.model.paged_attention import PagedKVPool
from engine.sampler import inverse_cdf_samples, target_probs
from scheduler.kv_blocks import KVBlockManager
from tests.engine.helpers import gguf_param

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    packed = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    pool = float32_pool(packed.config, 64 * BLOCK_SIZE)
    return reference, PackedModelRunner(packed, torch.device("cpu"), pool, BLOCK_SIZE)


def float32_pool(config, num_slots: int) -> PagedKVPool:
    """A CPU pool of NUM_SLOTS float32 slots shaped for CONFIG's keys and values."""
    head_dim = config.hidden_size // config.num_attention_heads
    return PagedKVPool(
        config.num_hidden_layers, num_slots, config.num_key_value_heads, head_dim, torch.float32, torch.device("cpu")
    )


def plain_logits(model, token_ids):
    """[len(token_ids), vocab] logits of one plain forward."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([token_ids])).logits[0]


def reference_logits(model, cache, token_ids, num_logits):
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([token_ids]), past_key_values=cache, use_cache=True, logits_to_keep=num_logits
        )
    return out.logits[0]


PATHS = {"all-gathered": 10**9, "long-chunks-in-place": 1}  # in_place_min_context of each attention path


def use_path(runner, path, monkeypatch):
    monkeypatch.setattr(runner, "in_place_min_context", PATHS[path])


@pytest.mark.parametrize("path", PATHS)
def test_packed_steps_match_per_request_forwards_through_prefill_drafts_and_rollback(models, path, monkeypatch):
    reference, runner = models
    use_path(runner, path, monkeypatch)
    blocks = KVBlockManager(num_blocks=21, block_size=BLOCK_SIZE)  # exactly enough: some tables end up fragmented
    long_prompt = [1] + [(7 * i) % 40 + 3 for i in range(39)]  # prefilled in two chunks, the first without logits
    prompts = {"a": [1, 5, 9, 13, 7, 3, 22], "b": [1, 30, 31], "c": [1] + list(range(10, 28)), "d": long_prompt[:25]}
    caches = {name: DynamicCache() for name in prompts}
    computed = {name: 0 for name in prompts}

    def step(new_tokens, num_logits):
        items = []
        for name, ids in new_tokens.items():
            table = blocks.grow(name, computed[name] + len(ids))
            items.append(chain_item(ids, computed[name], table, BLOCK_SIZE, num_logits[name]))
        got = runner.execute(ForwardBatch(items)).logits
        for (name, ids), logits in zip(new_tokens.items(), got):
            if caches[name].get_seq_length() > computed[name]:
                caches[name].crop(computed[name] - caches[name].get_seq_length())
            expected = reference_logits(reference, caches[name], ids, num_logits[name])
            assert logits.shape[0] == num_logits[name]
            if num_logits[name]:
                torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
            computed[name] += len(ids)

    step(prompts, {"a": 1, "b": 1, "c": 1, "d": 0})  # ragged prefill; d's chunk stops short of its prompt's end
    step({"d": long_prompt[25:]}, {"d": 1})
    step({"a": [4, 8, 12], "b": [6], "c": [2, 2]}, {"a": 3, "b": 1, "c": 2})  # last token + drafts
    for name, keep in (("a", 1), ("c", 2)):  # rejected drafts: roll back
        computed[name] -= keep
        blocks.shrink(name, computed[name])
    step({"a": [40, 41], "b": [7, 8, 9, 10, 11], "c": [3]}, {"a": 2, "b": 5, "c": 1})


# A tree after a cached context: the last real token (row 0), then two rows 9-10-11 and 20-21, and a third
# branch 9-30 that shares the first row's first token.
TREE_TOKENS = [8, 9, 10, 11, 20, 21, 30]
TREE_PARENTS = [-1, 0, 1, 2, 0, 4, 1]


def tree_paths(prefix):
    """Per row of the tree, the plain sequence its logits must match: the prefix plus the row's path."""
    paths = []
    for row in range(len(TREE_TOKENS)):
        path, node = [], row
        while node != -1:
            path.append(TREE_TOKENS[node])
            node = TREE_PARENTS[node]
        paths.append(prefix + path[::-1])
    return paths


@pytest.mark.parametrize("path", PATHS)
def test_every_tree_node_gets_the_logits_of_its_own_path_beside_a_chain_in_the_same_step(models, path, monkeypatch):
    reference, runner = models
    use_path(runner, path, monkeypatch)
    blocks = KVBlockManager(num_blocks=32, block_size=BLOCK_SIZE)
    context, other = [1, 5, 9, 13, 7, 3, 22, 6, 4], [1, 30, 31, 32]
    runner.execute(ForwardBatch([
        chain_item(context, 0, blocks.grow("t", len(context)), BLOCK_SIZE),
        chain_item(other, 0, blocks.grow("c", len(other)), BLOCK_SIZE),
    ]))
    tree = tree_item(
        TREE_TOKENS,
        TREE_PARENTS,
        len(context),
        blocks.grow("t", len(context) + len(TREE_TOKENS)),
        BLOCK_SIZE,
        logit_rows=list(range(len(TREE_TOKENS))),
    )
    chain = chain_item([33, 34], len(other), blocks.grow("c", len(other) + 2), BLOCK_SIZE, num_logits=2)
    assert tree.positions == [9, 10, 11, 12, 10, 11, 11] and not tree.is_chain
    tree_logits, chain_logits = runner.execute(ForwardBatch([tree, chain])).logits
    for row, path in enumerate(tree_paths(context)):
        torch.testing.assert_close(tree_logits[row], plain_logits(reference, path)[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chain_logits, plain_logits(reference, other + [33, 34])[-2:], rtol=1e-4, atol=1e-4)


def test_after_the_accepted_branch_moves_into_place_the_next_step_sees_exactly_that_path(models):
    reference, runner = models
    blocks = KVBlockManager(num_blocks=32, block_size=BLOCK_SIZE)
    context = [1, 5, 9, 13, 7, 3, 22, 6, 4]
    runner.execute(ForwardBatch([chain_item(context, 0, blocks.grow("t", len(context)), BLOCK_SIZE)]))
    table = blocks.grow("t", len(context) + len(TREE_TOKENS))
    runner.execute(ForwardBatch([tree_item(TREE_TOKENS, TREE_PARENTS, len(context), table, BLOCK_SIZE, [0])]))
    # the target took the second row: 8 20 21 (rows 0, 4, 5); 20 and 21 belong right after 8
    slot = slots_of(table, BLOCK_SIZE, 0, len(context) + len(TREE_TOKENS))
    base = len(context)
    runner.move_kv([(slot[base + 4], slot[base + 1]), (slot[base + 5], slot[base + 2])])
    num_cached = base + 3
    blocks.shrink("t", num_cached)
    table = blocks.grow("t", num_cached + 2)
    logits = runner.execute(ForwardBatch([chain_item([40, 41], num_cached, table, BLOCK_SIZE, 2)])).logits[0]
    torch.testing.assert_close(
        logits, plain_logits(reference, context + [8, 20, 21, 40, 41])[-2:], rtol=1e-4, atol=1e-4
    )


def test_look_ahead_rows_return_their_logits_to_the_drafter_and_change_nothing_else(models):
    """A look-ahead branch (SPECTRA's candidate pool) hangs off the cached context beside the real tokens:
    its logits come back as drafter rows, and the verifier's rows are those of the chain alone."""
    reference, runner = models
    blocks = KVBlockManager(num_blocks=32, block_size=BLOCK_SIZE)
    context = [1, 5, 9, 13, 7, 3]
    runner.execute(ForwardBatch([chain_item(context, 0, blocks.grow("s", len(context)), BLOCK_SIZE)]))
    # rows 0-1: the real chain 22 6; rows 2-3: a look-ahead guess 17 18 continuing the cached context
    tokens, parents = [22, 6, 17, 18], [-1, 0, -1, 2]
    item = tree_item(tokens, parents, len(context), blocks.grow("s", len(context) + 4), BLOCK_SIZE, logit_rows=[0, 1])
    item.drafter_rows = [2, 3]
    out = runner.execute(ForwardBatch([item]))
    torch.testing.assert_close(out.logits[0], plain_logits(reference, context + [22, 6])[-2:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        out.drafter_logits[0], plain_logits(reference, context + [17, 18])[-2:], rtol=1e-4, atol=1e-4
    )


def test_captures_return_the_hidden_states_and_attention_rows_of_a_plain_forward(models):
    reference, runner = models
    blocks = KVBlockManager(num_blocks=32, block_size=BLOCK_SIZE)
    context = [1, 5, 9, 13, 7, 3, 22, 6, 4]
    capture = CaptureSpec(hidden_layers=(1,), attention_heads=((0, 1), (1, 3), (1, 0)))
    first = chain_item(context[:6], 0, blocks.grow("s", 6), BLOCK_SIZE)
    first.hidden_rows, first.attention_rows = list(range(6)), [5]
    second = tree_item(context[6:] + [11], [-1, 0, 1, 1], 6, blocks.grow("s", 10), BLOCK_SIZE, [2, 3])
    second.hidden_rows, second.attention_rows = [0, 1, 2, 3], [2, 3]
    out_first = runner.execute(ForwardBatch([first], capture))
    out_second = runner.execute(ForwardBatch([second], capture))
    with torch.inference_mode():
        plain = reference(input_ids=torch.tensor([context]), output_hidden_states=True, output_attentions=True)
        branch = reference(
            input_ids=torch.tensor([context[:8] + [11]]), output_hidden_states=True, output_attentions=True
        )
    hidden = plain.hidden_states[1][0]  # [len, hidden] after the first decoder layer
    torch.testing.assert_close(out_first.hidden[0], hidden[:6], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out_second.hidden[0][:3], hidden[6:9], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out_second.hidden[0][3], branch.hidden_states[1][0, 8], rtol=1e-4, atol=1e-5)

    def attention(result, position):  # [heads in capture order, keys] of a plain forward at one query position
        return torch.stack([result.attentions[layer][0, head, position] for layer, head in capture.attention_heads])

    torch.testing.assert_close(out_first.attention[0][0], attention(plain, 5)[:, :6], rtol=1e-4, atol=1e-5)
    own = out_second.attention[0][0]  # row 2 (token 4), over all 10 keys in KV order; row 3, its sibling, is hidden
    torch.testing.assert_close(own[:, :9], attention(plain, 8), rtol=1e-4, atol=1e-5)
    assert (own[:, 9] == 0).all()
    sibling = out_second.attention[0][1]  # keys in KV order: the cached 6, then rows 0, 1, 2 (not its), 3 (itself)
    expected = attention(branch, 8)
    torch.testing.assert_close(sibling[:, :8], expected[:, :8], rtol=1e-4, atol=1e-5)
    assert (sibling[:, 8] == 0).all()  # row 2, its sibling, is invisible to it
    torch.testing.assert_close(sibling[:, 9], expected[:, 8], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("every_row", [True, False])
def test_several_capture_layers_come_side_by_side_in_the_order_asked(models, every_row):
    # every packed row kept (a decode or prompt step: the rows copied as they are) or some (their rows picked)
    reference, runner = models
    blocks = KVBlockManager(num_blocks=32, block_size=BLOCK_SIZE)
    first, second = [1, 5, 9, 13], [7, 3, 22]
    items = [chain_item(ids, 0, blocks.grow(name, len(ids)), BLOCK_SIZE) for name, ids in (("a", first), ("b", second))]
    items[0].hidden_rows, items[1].hidden_rows = [0, 1, 2, 3], [0, 1, 2] if every_row else [1]
    out = runner.execute(ForwardBatch(items, CaptureSpec(hidden_layers=(2, 1))))
    for item in items:
        item.hidden_rows = list(range(item.num_tokens))
    alone = {layer: runner.execute(ForwardBatch(items, CaptureSpec(hidden_layers=(layer,)))).hidden for layer in (1, 2)}
    with torch.inference_mode():  # after the first layer (the last's hidden state is transformers' final-normed one)
        for ids, kept in zip((first, second), alone[1]):
            plain = reference(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0]
            torch.testing.assert_close(kept, plain, rtol=1e-4, atol=1e-5)
    expected = [torch.cat([two, one], dim=-1) for two, one in zip(alone[2], alone[1])]
    assert torch.equal(out.hidden[0], expected[0])
    assert torch.equal(out.hidden[1], expected[1] if every_row else expected[1][1:2])


def test_a_capture_of_a_layer_the_model_lacks_is_refused_whenever_it_is_asked(models):
    _, runner = models
    blocks = KVBlockManager(num_blocks=32, block_size=BLOCK_SIZE)
    item = chain_item([1, 5, 9], 0, blocks.grow("s", 3), BLOCK_SIZE)
    item.hidden_rows = [2]
    runner.execute(ForwardBatch([item], CaptureSpec(hidden_layers=(1, 2))))  # the tiny model's two layers: served
    num_layers = runner.model.config.num_hidden_layers
    for layers in ((1, num_layers + 1), (0,)):
        with pytest.raises(ValueError, match="captures need layers"):
            runner.execute(ForwardBatch([item], CaptureSpec(hidden_layers=layers)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash-attn backend needs a CUDA device")
def test_flash_backend_matches_sdpa_on_cuda_with_a_tree_in_the_batch(tiny_model_dir):
    pytest.importorskip("flash_attn", reason="the flash-attn backend needs the flash-attn package")
    from engine.model.paged_attention import FLASH_BLOCK_SIZE

    device = torch.device("cuda")
    logits = {}
    for backend in ("sdpa", "flash"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).to(device).eval()
        config = model.config
        head_dim = config.hidden_size // config.num_attention_heads
        pool = PagedKVPool(
            config.num_hidden_layers, 8 * FLASH_BLOCK_SIZE, config.num_key_value_heads, head_dim, torch.bfloat16, device
        )
        runner = PackedModelRunner(model, device, pool, FLASH_BLOCK_SIZE, backend)
        blocks = KVBlockManager(num_blocks=8, block_size=FLASH_BLOCK_SIZE)
        a, b = [1] + list(range(3, 40)), [1, 30, 31]
        logits[backend] = runner.execute(ForwardBatch([
            chain_item(a, 0, blocks.grow("a", len(a)), FLASH_BLOCK_SIZE),
            chain_item(b, 0, blocks.grow("b", len(b)), FLASH_BLOCK_SIZE),
        ])).logits
        logits[backend] += runner.execute(ForwardBatch([
            chain_item([4, 8, 12], len(a), blocks.grow("a", len(a) + 3), FLASH_BLOCK_SIZE, 3),
            tree_item(TREE_TOKENS, TREE_PARENTS, len(b), blocks.grow("b", len(b) + 7), FLASH_BLOCK_SIZE,
                      list(range(7))),
        ])).logits
    for sdpa, flash in zip(logits["sdpa"], logits["flash"]):
        torch.testing.assert_close(flash, sdpa, rtol=2e-2, atol=2e-2)  # bfloat16 kernels sum in different orders


def test_a_forward_item_says_everything_as_plain_data():
    item = ForwardItem([7], [0], [3], [0], 0, logit_rows=[0])
    assert item.context_len == 1 and item.is_chain and item.num_tokens == 1


@pytest.mark.parametrize("attention", ["row-kernel", "matmuls"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4", gguf_param()])
def test_a_tokens_logits_are_bit_identical_whatever_forward_computes_it(
    tiny_model_dir, path, weights, attention, monkeypatch
):
    """Batch invariance: one prefill of the whole sequence, token-by-token decoding beside another request, chains of
    drafts, and a tree whose path runs between other branches give every position exactly the same logits, with
    contexts on both sides of the attention's key-padding steps (with bfloat16 activations a last-bit difference
    would move them by far more than greedy's near-tie allowance). Not so in float32, whose Linear kernels round a
    product of few rows differently (there differences stay ~1e-5, within the near-tie rule)."""
    from engine.model.weights import apply_weights

    use_attention(attention, monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    apply_weights(model, weights)
    assert_batch_invariant(model, path, monkeypatch, vocab=40)


@pytest.mark.parametrize("attention", ["row-kernel", "matmuls"])
@pytest.mark.parametrize("path", PATHS)
def test_a_tokens_logits_are_bit_identical_whatever_forward_computes_it_within_a_sliding_window(
    path, attention, monkeypatch
):
    """The same with a sliding window (Mistral's, 100 positions here) that the sequence outgrows: a row's keys keep
    their KV indices, so the keys outside its window are masked keys like the padding and the other branches, and
    its sum over the keys it sees is grouped the same in every forward."""
    from transformers import MistralConfig, MistralForCausalLM

    from engine.model.weights import apply_weights

    use_attention(attention, monkeypatch)
    torch.manual_seed(1234)
    config = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, sliding_window=100,
    )
    model = MistralForCausalLM(config).eval()
    apply_weights(model, "bfloat16")
    assert_batch_invariant(model, path, monkeypatch, vocab=40)


def use_attention(attention: str, monkeypatch) -> None:
    """Makes CPU attention run the row kernel or, as CPUs without the kernel do, the batched matmuls."""
    import engine.model.paged_attention as paged_attention

    if attention == "matmuls":  # the path of CPUs without AVX2 and FMA, or of a failed kernel build
        monkeypatch.setattr(paged_attention, "_row_kernel_runs", lambda: False)
    elif not paged_attention._row_kernel_runs():
        pytest.skip("the row attention kernel needs AVX-512F or AVX2 with FMA and a C++ compiler")


@pytest.mark.parametrize("path", PATHS)
def test_the_default_model_is_batch_invariant_with_the_weights_it_is_served_with(path, monkeypatch):
    """The same on the embedded model (head size 64, where the matmuls' blocking differs from the tiny model's)."""
    from engine.config import ModelConfig
    from engine.model.model_loader import load_model

    loaded = load_model(ModelConfig())
    assert loaded.weights in ("gguf", "float32")  # auto: what this host serves the embedded model with
    assert_batch_invariant(loaded.model, path, monkeypatch, vocab=40000)


@dataclass
class TreeLayout:
    parents: list[int]
    depths: list[int | None]  # each node's depth on the true path, None for a decoy


TREE_LAYOUTS = (
    TreeLayout([-1, -1, 0, 0, 2, 2, 5, 5, 5], [0, None, 1, None, None, 2, None, None, 3]),  # a decoy root first
    TreeLayout([-1, 0, 0, 2, 2, 4, 4, 0], [0, None, 1, None, 2, None, 3, None]),  # decoy leaves first
)


def assert_batch_invariant(model, path, monkeypatch, vocab: int) -> None:
    pool = float32_pool(model.config, 400 * BLOCK_SIZE)
    runner = PackedModelRunner(model, torch.device("cpu"), pool, BLOCK_SIZE)
    use_path(runner, path, monkeypatch)
    blocks = KVBlockManager(num_blocks=400, block_size=BLOCK_SIZE)
    tokens = [1] + [(1009 * i) % vocab + 3 for i in range(419)]  # 420: keys padded to 384, then to 448
    other = [1] + [(5 * i) % vocab + 3 for i in range(20)]

    def logits_in_steps(name: str, chunks: list[int]) -> torch.Tensor:
        done, rows = 0, []
        for n in chunks:
            items = [chain_item(tokens[done:done + n], done, blocks.grow(name, done + n), BLOCK_SIZE, n)]
            if n < 8:  # another request in the same forward
                items.append(chain_item(other, 0, blocks.grow(f"{name}-other", len(other)), BLOCK_SIZE, 1))
                blocks.free(f"{name}-other")
            rows.append(runner.execute(ForwardBatch(items)).logits[0])
            done += n
        return torch.cat(rows)

    whole = logits_in_steps("whole", [420])
    assert torch.equal(logits_in_steps("chains", [300, 77, 5, 4, 7, 27]), whole)
    assert torch.equal(logits_in_steps("decoding", [370] + [1] * 50), whole)
    # trees whose true path (the sequence's next tokens) runs between other branches, first or not first among
    # the paths, at several contexts: its nodes get the logits the whole prefill gave those positions
    for name in ("whole", "chains", "decoding"):
        blocks.free(name)
    for start in (380, 391, 402, 411):
        for i, layout in enumerate(TREE_LAYOUTS):
            name = f"tree-{start}-{i}"
            runner.execute(ForwardBatch([chain_item(tokens[:start], 0, blocks.grow(name, start), BLOCK_SIZE, 1)]))
            nodes = [tokens[start + depth] if depth is not None else 7 + row for row, depth in enumerate(layout.depths)]
            true_rows = [row for row, depth in enumerate(layout.depths) if depth is not None]
            tree = tree_item(nodes, layout.parents, start, blocks.grow(name, start + len(nodes)), BLOCK_SIZE, true_rows)
            assert torch.equal(runner.execute(ForwardBatch([tree])).logits[0],
                               whole[start:start + len(true_rows)]), (start, layout)
            blocks.free(name)


def test_items_with_a_choice_get_their_rows_tokens_and_the_others_their_logits(models):
    """A greedy item gets its logit rows' argmax and a sampled one its rows' samples at their uniforms (what the
    verifier would draw from those logits), neither any logits; beside them, an item with drafter rows gets both
    kinds of logits, as it would in a batch of its own."""
    _, runner = models
    blocks = KVBlockManager(num_blocks=64, block_size=BLOCK_SIZE)
    a, b, c = [1, 5, 9, 13, 2], [1, 30, 31, 7], [1, 8, 3]
    sampled = RowChoice(temperature=0.8, top_k=20, top_p=0.9, uniforms=[0.3, 0.95])

    def batch(choose: bool) -> ForwardBatch:
        greedy = chain_item(a, 0, blocks.grow("a", len(a)), BLOCK_SIZE, num_logits=3)
        other = chain_item(b, 0, blocks.grow("b", len(b)), BLOCK_SIZE, num_logits=1)
        other.drafter_rows = [1, 2]
        drawn = chain_item(c, 0, blocks.grow("c", len(c)), BLOCK_SIZE, num_logits=2)
        greedy.choice, drawn.choice = (RowChoice(), sampled) if choose else (None, None)
        return ForwardBatch([greedy, other, drawn])

    full, chosen = runner.execute(batch(False)), runner.execute(batch(True))
    assert full.chosen == [None, None, None] and chosen.logits[0] is None and chosen.logits[2] is None
    assert chosen.chosen[0] == full.logits[0].argmax(dim=-1).tolist() and chosen.chosen[1] is None
    assert chosen.chosen[2] == inverse_cdf_samples(target_probs(full.logits[2], sampled), sampled.uniforms)
    torch.testing.assert_close(chosen.logits[1], full.logits[1], rtol=0, atol=0)
    torch.testing.assert_close(chosen.drafter_logits[1], full.drafter_logits[1], rtol=0, atol=0)
