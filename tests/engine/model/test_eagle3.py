"""EAGLE-3 heads as draft models (engine/model/eagle3.py, drafters/head_draft.py): a head written in the public layout
loads and drafts, greedy output stays the target's, what the head reads, the layout it writes, what start-up refuses."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.exactness import divergence_verdict
from drafters.base import Draft
from drafters.config import SpecConfig
from drafters.head_draft import CHILDREN, SIBLINGS, TREE_WIDTH
from drafters.tree import TreeRows, chain_parents, depths
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model.cpu_kernels import fused_ops_available, kernels
from engine.model.eagle3 import (
    MIN_ROTATIONS,
    WEIGHTS_FILE,
    aux_layers,
    is_eagle3_head,
    load_eagle3_head,
    read_head_config,
    save_eagle3_head,
)
from engine.model.head_layout import MAX_KEPT, HeadLayout
from engine.model.weights import apply_head_weights
from engine.wire import SamplingParams
from scheduler.config import SchedulerConfig, SessionConfig
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import run_to_completion
from tests.engine.model.test_draft_model import SMALL_POOL, assert_greedy_outputs_equal, draft_engine
from tests.engine.model.test_fused_ops import ISAS, use_isa
from tests.engine.test_engine import prompts


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return Engine(EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"), spec=SpecConfig(drafter="none"),
        cache=CacheConfig(SMALL_POOL), sessions=SessionConfig(mode="off"),
    ))


@pytest.fixture(scope="module")
def plain_gguf(tiny_model_dir):
    """The tiny target in the CPU's GGUF blocks, where a head runs its lean layer and greedy requests draft trees."""
    return Engine(EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu", weights="gguf"), spec=SpecConfig(drafter="none"),
        cache=CacheConfig(SMALL_POOL), sessions=SessionConfig(mode="off"),
    ))


needs_fused_ops = pytest.mark.skipif(not fused_ops_available(),
                                     reason="the fused operators need a C++ compiler on x86-64")


@pytest.mark.parametrize("drafter,planner,weights", [
    ("draft", False, "auto"), ("draft", True, "auto"), ("copyspec+draft", False, "auto"),
    *(pytest.param(drafter, planner, "gguf", marks=needs_fused_ops)
      for drafter, planner in (("draft", False), ("draft", True), ("copyspec+draft", False))),
])
def test_greedy_output_with_a_head_equals_plain_decoding(
    plain, plain_gguf, tiny_model_dir, tiny_head_dir, drafter, planner, weights,
):
    """As chains with siblings (float32 weights: the packed runner) and as trees (GGUF blocks: the lean layer)."""
    engine = draft_engine(tiny_model_dir, tiny_head_dir, drafter, planner, weights)
    assert engine.draft_forward.drafts_trees == (weights == "gguf")
    assert engine.speculation.captures.hidden_layers == (1, 1, 2)  # the target keeps the states the head reads
    if planner:  # the head priced as nearly free: whether the planner drafts must not hang on this host's timings
        engine.scheduler.model_drafts.draft_seconds = lambda num_tokens: 1e-6
    outputs = assert_greedy_outputs_equal(plain_gguf if weights == "gguf" else plain, engine, prompts(6, seed=5),
                                          max_tokens=40)
    assert sum(o.spec.num_draft_tokens for o in outputs.values()) > 0, "the head must have drafted"


@needs_fused_ops
def test_greedy_trees_and_sampled_chains_in_one_round_keep_greedy_output_the_targets(
    plain_gguf, tiny_model_dir, tiny_head_dir,
):
    """One head forward carries greedy requests' tree spans beside sampled requests' chains."""
    engine = draft_engine(tiny_model_dir, tiny_head_dir, weights="gguf")
    forward, mixed_forwards = engine.draft_forward, []
    run = forward.run

    def record(chains, features, trees=None):
        kinds = {tree is None for tree in trees or [None] * len(chains)}
        mixed_forwards.append(kinds == {True, False})
        return run(chains, features, trees)

    forward.run = record
    batch = prompts(4, seed=6)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    mixed = run_to_completion(engine, batch, [greedy, sampled, greedy, sampled])
    reference = run_to_completion(plain_gguf, batch, [greedy] * 4)
    for i in (0, 2):
        ours, theirs = mixed[f"req-{i}"].new_token_ids, reference[f"req-{i}"].new_token_ids
        assert divergence_verdict(plain_gguf.runner.model, batch[i], theirs, ours) != "mismatch", i
    assert any(mixed_forwards)  # some forward carried both kinds


def recorded_drafts(engine: Engine) -> list[Draft]:
    """Every non-empty draft ENGINE's drafter proposes from now on, in order."""
    drafts, propose = [], engine.speculation.drafter.propose

    def keep(reqs):
        proposed = propose(reqs)
        drafts.extend(draft for draft in proposed if len(draft))
        return proposed

    engine.speculation.drafter.propose = keep
    return drafts


def test_a_head_drafts_only_tokens_of_its_draft_vocabulary(tiny_model_dir, tiny_head_dir):
    engine = draft_engine(tiny_model_dir, tiny_head_dir)
    drafts = recorded_drafts(engine)
    run_to_completion(engine, prompts(3, seed=9), [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True,
                                                                   seed=1)] * 3)
    drafted = [token for draft in drafts for token in draft.token_ids]
    assert drafted and all(token % 2 == 0 for token in drafted)  # the tiny head's draft ids map to even token ids


def path_probabilities(draft: Draft) -> list[float]:
    paths: list[float] = []
    for parent, estimate in zip(draft.parents, draft.acceptance):
        paths.append(estimate * (paths[parent] if parent >= 0 else 1.0))
    return paths


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@needs_fused_ops
def test_a_greedy_requests_head_draft_is_a_tree_of_its_likeliest_paths(tiny_model_dir, tiny_head_dir, temperature):
    engine = draft_engine(tiny_model_dir, tiny_head_dir, weights="gguf")
    drafts = recorded_drafts(engine)
    run_to_completion(engine, prompts(3, seed=9), [SamplingParams(temperature=temperature, max_tokens=20,
                                                                   ignore_eos=True, seed=1)] * 3)
    assert drafts
    branched = 0
    for draft in drafts:
        if temperature:  # a sampled request's tokens are draws from q: verified as a chain
            assert draft.parents == chain_parents(len(draft))
            continue
        level = depths(draft.parents)
        assert max(level) <= 4 and len(draft) <= (1 + SIBLINGS) * 4  # as many nodes as a chain with its siblings
        assert max(level) <= draft.forwards <= 4  # the forwards that grew it: its kept depth, or more
        assert all(token % 2 == 0 for token in draft.token_ids)  # all of the draft vocabulary
        for parent in {-1, *draft.parents}:
            children = [n for n, p in enumerate(draft.parents) if p == parent]
            assert len(children) <= CHILDREN and len({draft.token_ids[n] for n in children}) == len(children)
            # each node's acceptance estimate is the head's probability of it given its parent, likeliest first
            estimates = [draft.acceptance[n] for n in children]
            assert estimates == sorted(estimates, reverse=True) and sum(estimates) <= 1 + 1e-6
        assert all(0 < estimate <= 1 for estimate in draft.acceptance)
        # a node off a first child's sibling: the tree grows where its paths are likeliest, not along one chain
        ranks = [sum(1 for m in range(n) if draft.parents[m] == draft.parents[n]) for n in range(len(draft))]
        branched += any(ranks[p] > 0 for p in draft.parents if p >= 0)
    assert temperature or branched


@needs_fused_ops
def test_the_ends_a_forward_expands_are_shared_by_the_rounds_greedy_requests(tiny_model_dir, tiny_head_dir):
    """A head row costs about a tenth of a target row on a CPU: a round's trees expand TREE_WIDTH ends a forward
    together, one each at least, so a batch's drafting costs what its chains would once it has TREE_WIDTH requests."""
    engine = draft_engine(tiny_model_dir, tiny_head_dir, weights="gguf")
    forward, spans = engine.draft_forward, []
    run = forward.run

    def record(chains, features, trees=None):
        spans.append([len(tokens) for (_, tokens, _), tree in zip(chains, trees or []) if tree is not None])
        return run(chains, features, trees)

    forward.run = record
    run_to_completion(engine, prompts(1, seed=9), [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])
    assert max(max(rows, default=0) for rows in spans) == TREE_WIDTH  # alone, a request expands TREE_WIDTH ends
    spans.clear()
    run_to_completion(engine, prompts(3, seed=4), [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 3)
    assert spans and all(sum(rows) <= max(TREE_WIDTH, len(rows)) for rows in spans)
    assert any(len(rows) == 3 for rows in spans)


@needs_fused_ops
def test_a_greedy_heads_tree_grows_only_where_the_scheduler_says(tiny_model_dir, tiny_head_dir):
    engine = draft_engine(tiny_model_dir, tiny_head_dir, weights="gguf")
    asked = []
    engine.draft_forward.continuing = lambda probabilities: asked.append(list(probabilities)) or [
        probability > 0.3 for probability in probabilities]
    drafts = recorded_drafts(engine)
    run_to_completion(engine, prompts(3, seed=9), [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3)
    assert asked and all(0 < p <= 1 for probabilities in asked for p in probabilities)
    stopped = 0
    for draft in drafts:
        paths = path_probabilities(draft)
        assert all(paths[parent] > 0.3 for parent in draft.parents if parent >= 0)  # only likely paths went on
        stopped += max(depths(draft.parents)) < 4
    assert stopped  # some trees stopped short of the 4 levels they were allowed (the tiny head is unsure)


def test_the_head_reads_the_targets_states_as_a_first_forward_over_the_unread_tokens(tiny_model_dir, tiny_head_dir):
    """Each round's first head forward reads the real tokens the head has not read, with the target's fused states;
    drafted tokens' entries are computed again next round."""
    engine = draft_engine(tiny_model_dir, tiny_head_dir)
    forward = engine.speculation.drafter.forward
    runs = []
    run = forward.run

    def record(chains, features, trees=None):
        runs.append([(start, len(tokens), f.abs().sum(-1).gt(0).tolist()) for (_, tokens, start), f in
                     zip(chains, features)])
        return run(chains, features, trees)

    forward.run = record
    prompt = prompts(1, seed=2)[0]
    run_to_completion(engine, [prompt], [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])
    first = runs[0][0]
    assert first[0] == 0 and first[1] == len(prompt) + 1  # the whole prompt and the first generated token
    assert first[2] == [False] + [True] * len(prompt)  # position 0 reads zeros, every later one a target state
    catch_ups = [r[0] for r in runs if r[0][1] > 1 or not r[0][0]]
    assert all(all(reads) for _, _, reads in catch_ups[1:])


def test_a_prompt_prefix_the_cache_serves_is_not_computed_again_for_the_head(plain, tiny_model_dir, tiny_head_dir):
    """Prompts opening with a prefix an earlier request computed read it from the KV cache, the head reading zeros
    for its states there (one of them may resume the earlier request's drafter state, the others start without),
    and greedy output stays plain decoding's."""
    engine = Engine(EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu", draft_model=tiny_head_dir),
        cache=CacheConfig(SMALL_POOL), scheduler=SchedulerConfig(max_num_seqs=8, use_goodput_planner=False),
        spec=SpecConfig(drafter="draft", num_draft_tokens=4), sessions=SessionConfig(mode="implicit"),
    ))
    opening = prompts(1, seed=11)[0][:40]
    run_to_completion(engine, [opening], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])
    forward, first_reads = engine.speculation.drafter.forward, []
    run = forward.run

    def record(chains, features, trees=None):
        first_reads.extend(f.abs().sum(-1).gt(0).tolist() for (_, tokens, start), f in zip(chains, features)
                           if start == 0 and len(tokens) > 1)  # a request's first catch-up, from position 0
        return run(chains, features, trees)

    forward.run = record
    batch = [opening + tail[1:] for tail in prompts(3, seed=12)]
    outputs = assert_greedy_outputs_equal(plain, engine, batch, max_tokens=16)
    assert all(output.num_cached_tokens >= 32 for output in outputs.values())  # the opening's two full blocks
    assert sum(output.spec.num_draft_tokens for output in outputs.values()) > 0
    assert first_reads
    for reads in first_reads:  # the entry at p reads the state at p - 1: none for the 32 cached positions
        assert reads[:33] == [False] * 33 and all(reads[33:])


def test_a_head_the_target_cannot_feed_is_refused(tiny_model_dir, tiny_head_dir, tmp_path):
    with open(f"{tiny_head_dir}/config.json") as file:
        config = json.load(file)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 5]  # the tiny target has two layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / WEIGHTS_FILE).symlink_to(f"{tiny_head_dir}/{WEIGHTS_FILE}")
    with pytest.raises(ValueError, match="three target layers"):
        draft_engine(tiny_model_dir, str(tmp_path))
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 1, 2]
    config["vocab_size"] = TINY_VOCAB + 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocabulary"):
        draft_engine(tiny_model_dir, str(tmp_path))


def companion_engine(model_dir, draft_model, companion_model, planner=False, cache_dir=None) -> Engine:
    return Engine(EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu", draft_model=draft_model, companion_model=companion_model,
                          cache_dir=cache_dir),
        cache=CacheConfig(SMALL_POOL), scheduler=SchedulerConfig(max_num_seqs=8, use_goodput_planner=planner),
        spec=SpecConfig(drafter="draft", num_draft_tokens=4), sessions=SessionConfig(mode="off"),
    ))


@pytest.mark.parametrize("kinds", ["model draft, head companion", "head draft, early-exit companion"])
def test_a_companion_of_another_kind_than_its_draft_is_refused(
    tiny_model_dir, tiny_head_dir, tiny_draft_model_dir, kinds,
):
    draft, companion = ((tiny_draft_model_dir, tiny_head_dir) if kinds.startswith("model")
                        else (tiny_head_dir, "early-exit:1"))
    with pytest.raises(ValueError, match="of its own kind"):
        companion_engine(tiny_model_dir, draft, companion)


def test_a_companion_head_reading_other_target_layers_is_refused(
    tiny_model_dir, tiny_head_dir, tiny_companion_head_dir, tmp_path,
):
    for name in ("model.safetensors", "config.json"):
        (tmp_path / name).write_bytes((Path(tiny_companion_head_dir) / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 2]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="target layers"):
        companion_engine(tiny_model_dir, tiny_head_dir, str(tmp_path))


def test_a_companion_head_scores_each_token_the_head_drafts_and_greedy_output_stays_the_targets(
    plain, tiny_model_dir, tiny_head_dir, tiny_companion_head_dir,
):
    """SV with heads: the companion runs beside each of the head's forwards and each drafted token carries its
    estimate (without a calibrated table, A = min(1, c(x) / q(x))); chains, no siblings; output unchanged."""
    engine = companion_engine(tiny_model_dir, tiny_head_dir, tiny_companion_head_dir)
    drafter = engine.speculation.drafter
    assert drafter.companion is not None and engine.scheduler.model_drafts.companion_in_lockstep
    drafts = recorded_drafts(engine)
    runs = {"draft": [], "companion": []}  # the chains of each forward, by model
    for name, forward in (("draft", engine.draft_forward), ("companion", engine.companion_forward)):
        forward.run = lambda chains, features, trees=None, run=forward.run, name=name: runs[name].append(
            chains) or run(chains, features, trees)
    outputs = assert_greedy_outputs_equal(plain, engine, prompts(4, seed=5), max_tokens=30)
    assert sum(o.spec.num_draft_tokens for o in outputs.values()) > 0, "the head must have drafted"
    assert drafts and all(draft.parents == chain_parents(len(draft)) for draft in drafts)
    assert all(len(draft.acceptance) == len(draft) and all(0.0 <= a <= 1.0 for a in draft.acceptance)
               for draft in drafts)
    assert len({a for draft in drafts for a in draft.acceptance}) > 1, "each token scored by its own (S, A)"
    assert runs["draft"] and runs["companion"] == runs["draft"], "the companion runs each of the head's forwards"


def test_a_companion_heads_score_is_svs_overlap_and_acceptance_of_the_two_heads_distributions(
    tiny_model_dir, tiny_head_dir, tiny_companion_head_dir,
):
    """One drafting round by hand: the drafted token's (S, A) equal SV's formulas over the two heads' distributions
    widened to the target's vocabulary (each head gives 0 outside its own draft vocabulary)."""
    engine = companion_engine(tiny_model_dir, tiny_head_dir, tiny_companion_head_dir)
    drafter = engine.speculation.drafter
    drafts = recorded_drafts(engine)
    scored = []
    score = drafter._score
    drafter._score = lambda req, q, logits, token: score(req, q, logits, token) or scored.append(
        (q, logits, token, drafter._states[req.request_id].scores[-1]))
    run_to_completion(engine, prompts(1, seed=3), [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])
    assert drafts and scored
    for q, logits, token, (s, a) in scored:
        c = torch.full((TINY_VOCAB,), 0.0)
        c[torch.arange(0, TINY_VOCAB, 3)] = torch.softmax(logits.float(), dim=-1)
        assert q[1::2].sum() == 0 and 0.99 < q.sum() < 1.01
        assert (s, a) == pytest.approx((float(torch.minimum(q, c).sum()), min(1.0, float(c[token] / q[token]))))
    assert drafts[0].acceptance[0] == scored[0][3][1]
    assert any(0.0 < a < 1.0 for *_, (_, a) in scored) and any(s > 0.0 for *_, (s, _) in scored)


def test_a_written_head_keeps_the_public_layout(tiny_head_dir, tmp_path):
    embed = torch.nn.Embedding(TINY_VOCAB, 32)
    head = load_eagle3_head(tiny_head_dir, embed, torch.float32, torch.device("cpu"))
    save_eagle3_head(head, tmp_path, TINY_VOCAB, dtype=torch.float32)
    original, written = load_file(f"{tiny_head_dir}/{WEIGHTS_FILE}"), load_file(str(tmp_path / WEIGHTS_FILE))
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[name], original[name]) for name in original)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert is_eagle3_head(tmp_path) and not is_eagle3_head(tmp_path / "nothing")
    assert aux_layers(read_head_config(tmp_path), 2) == (1, 1, 2)
    assert aux_layers(read_head_config(tmp_path).__class__(), 30) == (2, 15, 27)  # vLLM's default without ids


@pytest.mark.parametrize("weights", ["gguf", "int8"])
def test_a_head_keeps_its_weights_as_the_target_does_and_output_stays_the_targets(tiny_model_dir, tiny_head_dir,
                                                                                  weights):
    def engine(drafter, draft_model=None):
        return Engine(EngineConfig(
            model=ModelConfig(model=tiny_model_dir, device="cpu", weights=weights, draft_model=draft_model),
            cache=CacheConfig(SMALL_POOL), scheduler=SchedulerConfig(max_num_seqs=8, use_goodput_planner=False),
            spec=SpecConfig(drafter=drafter, num_draft_tokens=4), sessions=SessionConfig(mode="off"),
        ))

    plain, drafting = engine("none"), engine("draft", tiny_head_dir)
    head = drafting.speculation.drafter.forward.model
    assert not any(isinstance(m, torch.nn.Linear) for m in head.modules())  # every Linear in the target's form
    outputs = assert_greedy_outputs_equal(plain, drafting, prompts(4, seed=6), max_tokens=30)
    assert sum(o.spec.num_draft_tokens for o in outputs.values()) > 0


def test_heads_are_written_in_bfloat16_by_default(tiny_head_dir, tmp_path):
    head = load_eagle3_head(tiny_head_dir, torch.nn.Embedding(TINY_VOCAB, 32), torch.float32, torch.device("cpu"))
    save_eagle3_head(head, tmp_path, TINY_VOCAB)
    written = load_file(str(tmp_path / WEIGHTS_FILE))
    assert written["fc.weight"].dtype == torch.bfloat16 and written["d2t"].dtype == torch.int64
    assert written["t2d"].sum() == len(written["d2t"])


def test_the_embedded_model_ships_a_head_that_draft_drafters_use_by_default():
    from engine.model.draft_model import SHIPPED_HEADS, shipped_head
    from engine.model.model_source import DEFAULT_MODEL_NAME

    path = shipped_head(DEFAULT_MODEL_NAME, "draft")
    assert path == str(SHIPPED_HEADS / DEFAULT_MODEL_NAME) and shipped_head(DEFAULT_MODEL_NAME, "copyspec+draft")
    assert shipped_head(DEFAULT_MODEL_NAME, "copyspec") is None and shipped_head("another-model", "draft") is None
    assert sum(f.stat().st_size for f in SHIPPED_HEADS.joinpath(DEFAULT_MODEL_NAME).iterdir()) <= 16 * 2**20


@needs_fused_ops
def test_the_lean_layer_computes_what_the_heads_modules_compute(tiny_model_dir, tiny_head_dir):
    """A head in 8-bit blocks (the CPU's gguf weights) runs its layer as one C++ call, laid out by the head's own
    layout (engine/model/head_layout.py) or by the packed runner: the same logits and outputs as its modules give,
    for two requests' catch-up chains of different lengths in one forward and then a drafted token each (the fused
    norms round in other last bits)."""
    engine = draft_engine(tiny_model_dir, tiny_head_dir)
    forward = engine.speculation.drafter.forward
    head = forward.model
    apply_head_weights(head, "gguf")
    head.make_lean()
    lean = head.lean
    assert lean is not None
    generator = torch.Generator().manual_seed(0)
    chains = [("a", prompts(1, seed=3)[0][:12], 0), ("b", prompts(1, seed=4)[0][:5], 0)]
    reads = [torch.randn(len(tokens), head.config.hidden_size, generator=generator) for _, tokens, _ in chains]
    for request_id, tokens, _ in chains:
        forward.blocks.grow(request_id, len(tokens) + 1)
    results = {}
    for path, (layer, layout) in {"layout": (lean, HeadLayout(forward.blocks.block_size)), "runner": (lean, None),
                                  "modules": (None, None)}.items():
        head.__dict__["lean"], forward.layout = layer, layout
        logits, outputs = forward.run(chains, reads)
        drafted = [(request_id, [int(row[0].argmax())], len(tokens))
                   for (request_id, tokens, _), row in zip(chains, logits)]
        next_logits, next_outputs = forward.run(drafted, outputs)
        results[path] = [*logits, *outputs, *next_logits, *next_outputs]
    for path in ("layout", "runner"):
        for got, expected in zip(results[path], results["modules"], strict=True):
            assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), path
    for request_id, _, _ in chains:
        forward.blocks.free(request_id)


def test_a_heads_layout_masks_each_row_to_its_own_position_and_keeps_key_slots_bounded():
    layout = HeadLayout(block_size=4)
    table = [7, 2, 9]
    tokens, positions, writes, last_rows, counts, spans = layout.lay_out([([11, 12, 13], 5, table), ([14], 2, [3])])
    assert tokens.tolist() == [11, 12, 13, 14] and positions.tolist() == [5, 6, 7, 2]
    assert writes.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 3 * 4 + 2] and last_rows.tolist() == [2, 3]
    assert counts == [1, 1]
    starts, lengths, key_slots, masks = spans
    assert starts == [0, 3] and lengths == [3, 1]
    assert key_slots[0][:8].tolist() == [28, 29, 30, 31, 8, 9, 10, 11]
    assert masks[0].shape == (1, 1, 3, len(key_slots[0])) and masks[0][0, 0].sum(-1).tolist() == [6, 7, 8]
    assert masks[1][0, 0].sum(-1).tolist() == [3]
    assert layout.lay_out([([15], 3, [3])])[3] is None  # every chain one row: every row's logits
    for context in range(1, 4 * 2000, 4):
        layout.lay_out([([1], context, list(range(context // 4 + 1)))])
    assert len(layout._slots) <= MAX_KEPT


def test_the_heads_rotary_table_gives_the_embeddings_own_numbers_past_its_first_length(tiny_model_dir,
                                                                                        tiny_head_dir):
    head = draft_engine(tiny_model_dir, tiny_head_dir).speculation.drafter.forward.model
    embeds = torch.zeros(3, head.config.hidden_size)
    for positions in ([[0, 7, 300]], [[5, MIN_ROTATIONS + 10, 3 * MIN_ROTATIONS]]):  # the second grows the table
        position_ids = torch.tensor(positions)
        cos, sin = head._rotation(embeds, position_ids)
        expected = [t[0, :, None, :] for t in head.model.rotary_emb(embeds, position_ids)]
        assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])


def test_a_tree_span_lays_out_each_node_at_its_depth_seeing_its_ancestors():
    layout = HeadLayout(block_size=4)
    rows = TreeRows(positions=[6, 6], write_at=[8, 9], context=6, sees=[[8, 7], [9]])
    tokens, positions, writes, kept, counts, spans = layout.lay_out([([21, 22], 6, [7, 2, 9], rows), ([14], 2, [3])])
    assert positions.tolist() == [6, 6, 2] and writes.tolist() == [9 * 4, 9 * 4 + 1, 3 * 4 + 2]
    assert kept is None and counts == [2, 1]  # every node's row comes back
    masks = spans[3]
    assert masks[0][0, 0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    assert masks[0][0, 0, 1].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 9]


@needs_fused_ops
@pytest.mark.parametrize("isa", ISAS)
def test_a_tree_nodes_row_computes_what_its_path_as_a_chain_computes(tiny_model_dir, tiny_head_dir, isa):
    """Two nodes at depth 1 in one span, then a child of the second at depth 2, written past the real tokens at
    slots of their own: each row's logits are those of the same tokens drafted as a chain, on each variant of the
    fused operators this CPU runs (AVX2 the path of CPUs without AVX-512)."""
    default = kernels().fused_ops_isa()
    use_isa(isa)
    try:
        tree_rows_against_chains(tiny_model_dir, tiny_head_dir)
    finally:
        kernels().set_fused_ops_isa(default)


def tree_rows_against_chains(tiny_model_dir, tiny_head_dir) -> None:
    engine = draft_engine(tiny_model_dir, tiny_head_dir, weights="gguf")
    forward = engine.speculation.drafter.forward
    assert forward.drafts_trees
    generator = torch.Generator().manual_seed(0)
    prompt = prompts(1, seed=3)[0][:9]
    context = len(prompt)
    reads = torch.randn(context, forward.model.config.hidden_size, generator=generator)
    forward.blocks.grow("tree", context + 4)
    (root_logits,), (root_output,) = forward.run([("tree", prompt, 0)], [reads])
    first, second = (int(t) for t in forward.target_ids[root_logits[0].topk(2).indices])
    level1 = TreeRows([context] * 2, [context, context + 1], context, [[context], [context + 1]])
    logits1, outputs1 = forward.run([("tree", [first, second], context)], [root_output.expand(2, -1)], [level1])
    child = int(forward.target_ids[logits1[0][1].argmax()])
    level2 = TreeRows([context + 1], [context + 2], context, [[context + 2, context + 1]])
    logits2, _ = forward.run([("tree", [child], context + 1)], [outputs1[0][1:2]], [level2])
    cases = ((0, [first], logits1[0][0], [root_output]), (1, [second], logits1[0][1], [root_output]),
             (2, [second, child], logits2[0][0], [root_output, outputs1[0][1:2]]))
    for index, path, tree_logits, feature_rows in cases:
        chain_id = f"chain-{index}"
        forward.blocks.grow(chain_id, context + len(path))
        forward.run([(chain_id, prompt, 0)], [reads])
        chain_logits, _ = forward.run([(chain_id, path, context)], [torch.cat(feature_rows)])
        assert torch.allclose(chain_logits[0][-1], tree_logits, atol=1e-4, rtol=1e-4), path
        forward.blocks.free(chain_id)
    forward.blocks.free("tree")
