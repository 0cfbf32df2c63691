"""Draft models the engine owns: an early exit of the target (sharing its weights and KV) and a separate model
(its own KV pool over the same block tables); greedy exactness, the KV they hold, and what start-up refuses."""
import pytest

from bench.exactness import divergence_verdict
from drafters.config import SpecConfig
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.wire import EngineRequest, SamplingParams
from scheduler.config import SchedulerConfig, SessionConfig
from tests.engine.helpers import run_to_completion
from tests.engine.test_engine import prompts

SMALL_POOL = 0.05  # GiB: the pool is zeroed at start-up, and an engine lives until the garbage collector finds it


def draft_engine(model_dir, draft_model, drafter="draft", planner=False, weights="auto", **cache):
    cache.setdefault("kv_cache_memory_gib", SMALL_POOL)
    return Engine(EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu", draft_model=draft_model, weights=weights),
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(max_num_seqs=8, use_goodput_planner=planner),
        spec=SpecConfig(drafter=drafter, copy_gamma=2, num_draft_tokens=4),
        sessions=SessionConfig(mode="off"),
    ))


def assert_greedy_outputs_equal(plain: Engine, engine: Engine, batch: list[list[int]], max_tokens: int) -> dict:
    """ENGINE's greedy outputs for BATCH equal PLAIN's (near-tie rule); returns ENGINE's outputs."""
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * len(batch)
    reference, outputs = run_to_completion(plain, batch, params), run_to_completion(engine, batch, params)
    for i, prompt in enumerate(batch):
        ref, out = reference[f"req-{i}"].new_token_ids, outputs[f"req-{i}"].new_token_ids
        assert divergence_verdict(plain.runner.model, prompt, ref, out) != "mismatch", i
    return outputs


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return Engine(EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"), spec=SpecConfig(drafter="none"),
        cache=CacheConfig(SMALL_POOL), sessions=SessionConfig(mode="off"),
    ))


@pytest.mark.parametrize("draft", ["early-exit:1", "separate"])
@pytest.mark.parametrize("drafter,planner", [("draft", False), ("draft", True), ("copyspec+draft", False)])
def test_greedy_output_with_a_draft_model_equals_plain_decoding(
    plain, tiny_model_dir, tiny_draft_model_dir, draft, drafter, planner
):
    engine = draft_engine(tiny_model_dir, tiny_draft_model_dir if draft == "separate" else draft, drafter, planner)
    if planner:  # the draft priced as nearly free: whether the planner drafts must not hang on this host's timings
        engine.scheduler.model_drafts.draft_seconds = lambda num_tokens: 1e-6
    outputs = assert_greedy_outputs_equal(plain, engine, prompts(6, seed=3), max_tokens=40)
    drafted = sum(o.spec.num_draft_tokens for o in outputs.values())
    assert drafted > 0, "the draft model must have drafted"
    if not planner and draft == "early-exit:1":  # the early exit shares the target's embedding and head: it hits
        assert sum(o.spec.num_accepted_tokens for o in outputs.values()) > 0


def test_copy_first_asks_the_scheduler_for_model_drafts_only_for_requests_copyspec_left_without_a_draft(tiny_model_dir):
    # without the planner every request copyspec leaves without a draft drafts with the model: with it, whether the
    # model drafts at all depends on the latency profiled at start-up, which a busy host skews
    engine = draft_engine(tiny_model_dir, "early-exit:1", "copyspec+draft", planner=False)
    asked, steps = [], []
    reserve, set_drafts = engine.scheduler.reserve_model_drafts, engine.scheduler.set_drafts

    def record_reserve(reqs, max_tokens, source, beside, **kwargs):
        asked.append(({r.request_id for r in reqs}, {r.request_id for r, _ in beside}))
        return reserve(reqs, max_tokens, source, beside, **kwargs)

    engine.scheduler.reserve_model_drafts = record_reserve
    engine.scheduler.set_drafts = lambda reqs, drafts: steps.append((asked.pop() if asked else (set(), set()), {
        req.request_id: draft.source for req, draft in zip(reqs, drafts) if len(draft)})) or set_drafts(reqs, drafts)
    batch = prompts(6, seed=3)
    run_to_completion(engine, batch, [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(batch))
    copied = [{i for i, source in sources.items() if source == "copyspec"} for _, sources in steps]
    assert any(copied) and any("draft" in sources.values() for _, sources in steps), "both kinds of draft must be made"
    for ((asked_ids, beside_ids), _), copied_ids in zip(steps, copied):
        assert not asked_ids & copied_ids  # a copied request holds no blocks for the model...
        assert beside_ids == copied_ids  # ...but weighs against it: the model's forwards delay it too


def test_the_scheduler_is_told_the_tokens_each_draft_forward_carried(tiny_model_dir, tiny_draft_model_dir):
    # a round's first forward reads what the draft model has not read (the whole prompt, at the first round): priced
    # by those tokens, a long one does not teach the scheduler that every draft forward is slow
    engine = draft_engine(tiny_model_dir, tiny_draft_model_dir)
    seen, observe = [], engine.scheduler.observe_drafting_seconds
    engine.scheduler.observe_drafting_seconds = lambda seconds, forwards, companion=(): (
        seen.append(list(forwards)) or observe(seconds, forwards, companion))
    prompt = prompts(1, seed=3)[0]
    run_to_completion(engine, [prompt], [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)])
    rounds = [forwards for forwards in seen if forwards]
    assert len(rounds) > 1 and rounds[0] == [len(prompt) + 1, 1, 1, 1]
    assert all(forwards[0] >= 1 and forwards[1:] == [1] * (len(forwards) - 1) for forwards in rounds[1:])


def test_an_early_exit_shares_the_targets_weights_and_kv_pool(tiny_model_dir):
    engine = draft_engine(tiny_model_dir, "early-exit:1")
    draft, target = engine.draft_forward.runner, engine.runner
    assert draft.pool is target.pool
    assert len(draft.model.model.layers) == 1 and draft.model.model.layers[0] is target.model.model.layers[0]
    assert draft.model.lm_head is target.model.lm_head and len(target.model.model.layers) == 2


def test_a_separate_draft_model_splits_the_kv_memory_by_bytes_per_position(tiny_model_dir, tiny_draft_model_dir):
    alone = draft_engine(tiny_model_dir, "early-exit:1", kv_cache_memory_gib=0.01)
    with_draft = draft_engine(tiny_model_dir, tiny_draft_model_dir, kv_cache_memory_gib=0.01)
    # target: 2 layers x 2 KV heads x 8 dims, draft: 1 layer of the same: the target keeps 2/3 of the positions
    assert with_draft.scheduler.blocks.num_blocks == pytest.approx(alone.scheduler.blocks.num_blocks * 2 / 3, abs=1)
    draft_pool = with_draft.draft_forward.runner.pool
    assert draft_pool is not with_draft.runner.pool
    assert draft_pool.keys.shape[1] == with_draft.runner.pool.keys.shape[1]


@pytest.mark.parametrize("draft", ["early-exit:1", "separate"])
def test_every_models_kv_blocks_return_when_requests_finish_abort_or_are_preempted(
    tiny_model_dir, tiny_draft_model_dir, draft
):
    # a pool of 20 blocks of 16 for 8 requests of up to ~120 positions: requests are preempted and recomputed
    engine = draft_engine(
        tiny_model_dir,
        tiny_draft_model_dir if draft == "separate" else draft,
        block_size=16,
        kv_cache_memory_gib=20 * 16 * (2 * 2 * 2 * 8 * 4 + (2 * 1 * 2 * 8 * 4 if draft == "separate" else 0)) / 2**30,
    )
    blocks = engine.scheduler.blocks
    assert blocks.num_blocks == 20
    batch = prompts(8, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(batch)
    stats = []
    run_to_completion(engine, batch, params, stats)
    assert sum(s.num_preemptions for s in stats) > 0, "the pool must be small enough to preempt"
    assert blocks.num_free_blocks == blocks.num_blocks and not blocks.block_tables
    engine.add_request(EngineRequest("to-abort", batch[0], params[0]))
    for _ in range(3):
        engine.step()
    assert blocks.num_free_blocks < blocks.num_blocks
    engine.abort("to-abort")
    assert blocks.num_free_blocks == blocks.num_blocks and not blocks.block_tables
    assert not engine.speculation.drafter._states, "the drafter forgets finished and aborted requests"


def test_a_draft_model_with_another_vocabulary_fails_start_up(tiny_model_dir, tiny_other_vocab_dir):
    with pytest.raises(ValueError, match="vocabulary of 64 tokens and the target one of 48"):
        draft_engine(tiny_model_dir, tiny_other_vocab_dir)


@pytest.mark.parametrize("spec", ["early-exit:2", "early-exit:0", "early-exit:x"])
def test_an_early_exit_needs_fewer_layers_than_the_target(tiny_model_dir, spec):
    with pytest.raises(ValueError, match=r"layer count in \[1, 1\]"):
        draft_engine(tiny_model_dir, spec)


def test_the_draft_drafter_needs_a_draft_model(tiny_model_dir):
    with pytest.raises(ValueError, match="--draft-model"):
        draft_engine(tiny_model_dir, None)


def test_seeded_model_draft_requests_are_reproducible_for_the_same_drafts(tiny_model_dir):
    """A seeded request samples its drafts and its accept tests from generators of its own: the same request gives
    the same tokens run after run (the residual of a rejected draft depends on the draft, so the tokens may differ
    from those the same seed samples without speculation)."""
    batch = prompts(3, seed=11)
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, ignore_eos=True, seed=100 + i) for i in range(3)
    ]
    runs = [run_to_completion(draft_engine(tiny_model_dir, "early-exit:1"), batch, params) for _ in range(2)]
    assert {k: o.new_token_ids for k, o in runs[0].items()} == {k: o.new_token_ids for k, o in runs[1].items()}
    assert sum(o.spec.num_accepted_tokens for o in runs[0].values()) > 0
