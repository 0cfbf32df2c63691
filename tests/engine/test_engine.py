"""The engine on a tiny random model: exactness of speculation (chains and trees), KV rollback and moves,
request validation."""
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.exactness import divergence_verdict
from drafters.config import SpecConfig
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.wire import EngineRequest, SamplingParams
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import run_to_completion

SMALL_POOL = 0.05  # GiB: the pool is zeroed at start-up, and the module keeps its engines


def make_engine(model_dir, drafter, planner=True, cache_dir=None):
    from scheduler.config import SchedulerConfig

    return Engine(EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu", cache_dir=cache_dir),
        cache=CacheConfig(SMALL_POOL),
        scheduler=SchedulerConfig(max_num_seqs=8, use_goodput_planner=planner),
        spec=SpecConfig(drafter=drafter, copy_gamma=2, ngram_k=5, ngram_w=4),
    ))


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("tables"))
    engines = {
        "none": make_engine(tiny_model_dir, "none"),
        "copyspec": make_engine(tiny_model_dir, "copyspec", planner=False),  # verify every draft: most rejections
        "copyspec-planned": make_engine(tiny_model_dir, "copyspec"),
        "ngram": make_engine(tiny_model_dir, "ngram", planner=False, cache_dir=cache_dir),  # every tree node verified
        "ngram-planned": make_engine(tiny_model_dir, "ngram", cache_dir=cache_dir),
        "spectra": make_engine(tiny_model_dir, "spectra", planner=False),
        "spectra-planned": make_engine(tiny_model_dir, "spectra"),
    }
    for name in ("ngram", "ngram-planned"):  # the tiny vocabulary's bigram table takes a moment to build
        assert engines[name].speculation.drafter.bigram.wait(60) is not None
    return engines


def prompts(num, seed=0):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(5, 40))] * 2 for _ in range(num)]


def test_greedy_speculation_equals_plain_decoding(engines):
    batch = prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * len(batch)
    reference = run_to_completion(engines["none"], batch, params)
    model = engines["none"].runner.model
    for name in ("copyspec", "copyspec-planned", "ngram", "ngram-planned", "spectra", "spectra-planned"):
        outputs = run_to_completion(engines[name], batch, params)
        for i, prompt in enumerate(batch):
            ref, out = reference[f"req-{i}"].new_token_ids, outputs[f"req-{i}"].new_token_ids
            assert divergence_verdict(model, prompt, ref, out) != "mismatch", (name, i)
        assert sum(o.spec.num_accepted_tokens for o in outputs.values()) > 0, f"{name} must exercise speculation"
    # without the planner every chain of spectra's candidate pool rode in the forwards as look-ahead rows
    assert engines["spectra"].speculation.drafter.lookahead_yield.rows > 0


def test_spectra_drafts_from_earlier_responses_and_stays_exact(engines):
    """A second run of the same prompts, each answer in the traffic index: retrieval guesses are tried and hit."""
    batch = prompts(4, seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(batch)
    reference = run_to_completion(engines["none"], batch, params)
    drafter = engines["spectra"].speculation.drafter
    for _ in range(2):
        outputs = run_to_completion(engines["spectra"], batch, params)
        for i, prompt in enumerate(batch):
            ref, out = reference[f"req-{i}"].new_token_ids, outputs[f"req-{i}"].new_token_ids
            assert divergence_verdict(engines["none"].runner.model, prompt, ref, out) != "mismatch", i
    assert drafter.traffic.num_documents >= len(batch)
    # tree nodes are rated by the first guess through them: a retrieval guess's own nodes are those past the core's
    assert sum(hits for (kind, _), (_, hits) in drafter.rates.scored().items() if kind.startswith("traffic")) > 0


def model_ngrams_of(engine, batch):
    """A table of ENGINE's own greedy next tokens after the contexts its greedy answers to BATCH hold (confidence
    0.9: every guess is priced as sure)."""
    from drafters.model_ngrams import ModelNgrams

    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(batch)
    answers = run_to_completion(engine, batch, params)
    sequences = []
    for i, prompt in enumerate(batch):
        tokens = prompt + answers[f"req-{i}"].new_token_ids
        sequences.append((tokens[len(prompt) - 1:-1], tokens[len(prompt):], [0.9] * (len(tokens) - len(prompt))))
    return ModelNgrams.from_predictions(sequences)


def test_spectra_drafting_from_the_model_ngrams_stays_exact(engines, monkeypatch):
    """Every guess verified (planner off), the table's among them: built from other prompts, its guesses are right
    where the tiny model's answers fall into the same cycles and wrong elsewhere; the output stays `none`'s."""
    drafter = engines["spectra"].speculation.drafter
    monkeypatch.setattr(drafter, "model_ngrams", model_ngrams_of(engines["none"], prompts(6, seed=31)))
    batch = prompts(6, seed=32)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(batch)
    reference = run_to_completion(engines["none"], batch, params)
    outputs = run_to_completion(engines["spectra"], batch, params)
    for i, prompt in enumerate(batch):
        ref, out = reference[f"req-{i}"].new_token_ids, outputs[f"req-{i}"].new_token_ids
        assert divergence_verdict(engines["none"].runner.model, prompt, ref, out) != "mismatch", i
    scored = [counts for (kind, _), counts in drafter.rates.scored().items() if kind.startswith("model:")]
    assert sum(hits for _, hits in scored) > 0 and sum(tried - hits for tried, hits in scored) > 0


def test_resting_requests_draft_the_model_ngrams_guess_alone_and_stay_exact(engines, monkeypatch):
    """Every request rests from proposing (the gate told so): its drafts are the table's guesses alone, which the
    planner verifies by their kinds' rates, a verified row priced at 1 % of a step (the measured prices of the tiny
    model's rows swing with the host's load); accepted and rejected, the output stays `none`'s."""
    from scheduler.latency import LatencyModel, StepOverhead

    engine = engines["spectra-planned"]
    drafter = engine.speculation.drafter
    monkeypatch.setattr(engine.scheduler, "latency", LatencyModel({1: 1.0, 101: 2.0}))
    monkeypatch.setattr(engine.scheduler, "step_overhead", StepOverhead())
    monkeypatch.setattr(engine.scheduler.step_overhead, "observe", lambda *args, **kwargs: None)
    monkeypatch.setattr(drafter, "model_ngrams", model_ngrams_of(engines["none"], prompts(6, seed=31)))
    monkeypatch.setattr(engine.scheduler.gate, "proposes", lambda request_id: False)
    monkeypatch.setattr(engine.scheduler.gate, "resting", lambda request_id: True)
    monkeypatch.setattr(drafter, "guess_tree", None)  # the full proposal is never built
    batch = prompts(6, seed=32)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(batch)
    reference = run_to_completion(engines["none"], batch, params)
    outputs = run_to_completion(engine, batch, params)
    for i, prompt in enumerate(batch):
        ref, out = reference[f"req-{i}"].new_token_ids, outputs[f"req-{i}"].new_token_ids
        assert divergence_verdict(engines["none"].runner.model, prompt, ref, out) != "mismatch", i
    assert sum(o.spec.num_accepted_tokens for o in outputs.values()) > 0
    assert sum(o.spec.num_draft_tokens - o.spec.num_accepted_tokens for o in outputs.values()) > 0


@pytest.mark.parametrize("drafter", ["copyspec", "ngram", "spectra"])
def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(engines, drafter):
    batch = prompts(4, seed=3)
    params = [
        SamplingParams(temperature=0.5, top_p=0.95, seed=11 + i, max_tokens=60, ignore_eos=True)
        for i in range(len(batch))
    ]
    reference = run_to_completion(engines["none"], batch, params)
    speculative = run_to_completion(engines[drafter], batch, params)
    assert sum(o.spec.num_accepted_tokens for o in speculative.values()) > 0, (
        "drafts must be accepted for this to mean something"
    )
    assert sum(o.spec.num_draft_tokens - o.spec.num_accepted_tokens for o in speculative.values()) > 0, "and rejected"
    for request_id, output in reference.items():
        assert speculative[request_id].new_token_ids == output.new_token_ids, request_id


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_rows_sampled_by_the_runner_give_the_verifiers_own_tokens(engines, drafter, monkeypatch):
    """On a GPU the runner draws a sampled request's rows itself (each at its depth's uniform, the verifier walking
    the drawn tokens); on this CPU, made to, it gives exactly the tokens the verifier's own draws give, through the
    trees of n-gram drafts too; requests asking for log-probabilities keep their logits."""
    batch = prompts(4, seed=12)
    params = [SamplingParams(temperature=0.7, top_k=30, top_p=0.9, seed=40 + i, max_tokens=40, ignore_eos=True,
                             logprobs=0 if i == 3 else None) for i in range(len(batch))]
    engine = engines[drafter]
    lazily = run_to_completion(engine, batch, params)
    chosen = []
    original = engine.runner.execute
    monkeypatch.setattr(engine.runner, "samples_on_device", True)
    monkeypatch.setattr(engine.runner, "execute", lambda b: chosen.append(b) or original(b))
    on_device = run_to_completion(engine, batch, params)
    assert any(item.choice is not None and item.choice.uniforms for b in chosen for item in b.items)
    for request_id, output in lazily.items():
        assert on_device[request_id].new_token_ids == output.new_token_ids, request_id


def test_tree_drafts_move_accepted_branches_that_are_not_the_first(engines):
    """The n-gram trees' accepted path is often a later sibling: its KV must be moved, and output stays exact."""
    batch = prompts(6, seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(batch)
    engine = engines["ngram"]
    moves = []
    original = engine.runner.move_kv
    engine.runner.move_kv = lambda kv_moves: (moves.extend(kv_moves), original(kv_moves))
    try:
        outputs = run_to_completion(engine, batch, params)
    finally:
        engine.runner.move_kv = original
    reference = run_to_completion(engines["none"], batch, params)
    assert moves, "some accepted branch must have been a later sibling for this test to mean something"
    for i, prompt in enumerate(batch):
        ref, out = reference[f"req-{i}"].new_token_ids, outputs[f"req-{i}"].new_token_ids
        assert divergence_verdict(engines["none"].runner.model, prompt, ref, out) != "mismatch", i


def test_requests_in_flight_all_progress_and_match_alone(engines):
    batch = prompts(4, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(batch)
    together = run_to_completion(engines["copyspec-planned"], batch, params)
    for i, prompt in enumerate(batch):
        alone = run_to_completion(engines["copyspec-planned"], [prompt], params[:1])["req-0"]
        assert alone.new_token_ids == together[f"req-{i}"].new_token_ids


@pytest.mark.parametrize(
    "prompt, max_tokens, message",
    [
        ([], 5, "empty"),
        ([1, TINY_VOCAB + 3], 5, "token ids"),
        ([1, -1], 5, "token ids"),
        ([1] * 2000, 5, "context"),
        ([1, 2], 0, "max_tokens"),
    ],
)
def test_bad_requests_get_an_error_output_and_the_engine_goes_on(engines, prompt, max_tokens, message):
    engine = engines["none"]
    error = engine.add_request(EngineRequest("bad", prompt, SamplingParams(max_tokens=max_tokens)))
    assert error.finish_reason == "error" and error.error.kind == "invalid_request" and message in error.error.message
    ok = run_to_completion(engine, [[1, 5, 6]], [SamplingParams(temperature=0.0, max_tokens=3)])
    assert len(ok["req-0"].new_token_ids) >= 1


def test_abort_frees_the_request(engines):
    engine = engines["copyspec-planned"]
    engine.add_request(EngineRequest("gone", [1, 5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()
    blocks = engine.scheduler.blocks
    assert "gone" in blocks.block_tables and blocks.num_free_blocks < blocks.num_blocks
    assert engine.abort("gone").finish_reason == "abort"
    assert "gone" not in blocks.block_tables and blocks.usage == 0 and not engine.has_work
    engine.scheduler.sessions.reclaim(blocks.num_blocks)  # what the aborted turn left for its session's next turn
    assert blocks.num_free_blocks == blocks.num_blocks
    assert engine.abort("gone") is None


def cuda_engine(tiny_model_dir, drafter, backend, dtype, graph_max_tokens=256):
    from engine.config import CacheConfig
    from scheduler.config import SchedulerConfig

    return Engine(EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cuda", dtype=dtype),
        cache=CacheConfig(kv_cache_memory_gib=0.25, attention_backend=backend, cuda_graph_max_tokens=graph_max_tokens),
        scheduler=SchedulerConfig(max_num_seqs=8, use_goodput_planner=False),  # verify every draft
        spec=SpecConfig(drafter=drafter, copy_gamma=2),
    ))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="exercises the CUDA path; needs a CUDA device")
@pytest.mark.parametrize("backend, dtype", [("sdpa", "float32"), ("triton", "float32"), ("triton", "bfloat16"),
                                            ("flash", "bfloat16")])
def test_greedy_speculation_on_cuda_equals_plain_decoding(tiny_model_dir, backend, dtype):
    if backend == "flash":
        pytest.importorskip("flash_attn", reason="the flash backend needs the flash-attn package")
    batch = prompts(8, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * len(batch)
    plain, speculative = (cuda_engine(tiny_model_dir, d, backend, dtype) for d in ("none", "copyspec"))
    assert (plain.runner.graphs is not None) == (backend == "triton"), "triton captures CUDA graphs; the others not"
    reference = run_to_completion(plain, batch, params)
    outputs = run_to_completion(speculative, batch, params)
    assert sum(o.spec.num_draft_tokens for o in outputs.values()) > 0, "the test must exercise speculation"
    for i, prompt in enumerate(batch):
        ref, out = reference[f"req-{i}"].new_token_ids, outputs[f"req-{i}"].new_token_ids
        assert divergence_verdict(plain.runner.model, prompt, ref, out) != "mismatch", i
    for engine in (plain, speculative):
        assert engine.scheduler.blocks.usage == 0, (
            "no request holds blocks once all finished (sessions may keep theirs)"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="exercises the CUDA path; needs a CUDA device")
@pytest.mark.parametrize("drafter", ["none", "copyspec"])
def test_cuda_graphs_leave_greedy_output_unchanged(tiny_model_dir, drafter):
    batch = prompts(8, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * len(batch)
    graphed, eager = (cuda_engine(tiny_model_dir, drafter, "triton", "float32", n) for n in (256, 0))
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    replays = []
    original = graphed.runner.graphs.forward_logits
    graphed.runner.graphs.forward_logits = lambda b: replays.append(1) or original(b)
    with_graphs, without = run_to_completion(graphed, batch, params), run_to_completion(eager, batch, params)
    assert len(replays) > 10, "decoding steps must replay graphs"
    for i in range(len(batch)):
        assert with_graphs[f"req-{i}"].new_token_ids == without[f"req-{i}"].new_token_ids, i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="exercises the CUDA path; needs a CUDA device")
@pytest.mark.parametrize("drafter", ["copyspec", "ngram"])
def test_seeded_sampling_on_cuda_gives_the_same_tokens_with_and_without_speculation(tiny_model_dir, drafter):
    """On a GPU the runner samples each row at its depth's uniform and only ids reach the host: chains (copyspec)
    and trees (n-grams) must walk those draws to exactly the tokens plain sampling draws, graphs replaying."""
    batch = prompts(8, seed=13)
    params = [SamplingParams(temperature=0.7, top_k=30, top_p=0.9, seed=70 + i, max_tokens=60, ignore_eos=True)
              for i in range(len(batch))]
    plain, speculative = (cuda_engine(tiny_model_dir, d, "triton", "float32") for d in ("none", drafter))
    assert plain.runner.samples_on_device and speculative.runner.graphs is not None
    if drafter == "ngram":  # the bigram table builds in the background
        assert speculative.speculation.drafter.bigram.wait(60) is not None
    reference = run_to_completion(plain, batch, params)
    outputs = run_to_completion(speculative, batch, params)
    assert sum(o.spec.num_accepted_tokens for o in outputs.values()) > 0, "drafts must be accepted"
    assert sum(o.spec.num_draft_tokens - o.spec.num_accepted_tokens for o in outputs.values()) > 0, "and rejected"
    for i in range(len(batch)):
        assert outputs[f"req-{i}"].new_token_ids == reference[f"req-{i}"].new_token_ids, i


@pytest.fixture(scope="module")
def pld_engines(tiny_model_dir, tmp_path_factory):
    from scheduler.config import SchedulerConfig

    def engine(ranking, **spec):
        return Engine(EngineConfig(
            model=ModelConfig(model=tiny_model_dir, device="cpu", cache_dir=str(tmp_path_factory.mktemp("cache"))),
            cache=CacheConfig(SMALL_POOL),
            scheduler=SchedulerConfig(max_num_seqs=8, use_goodput_planner=False),
            spec=SpecConfig(drafter=ranking, **spec),
        ))

    return {"pld": engine("pld"), "pld-plus": engine("pld-plus", pld_plus_ranking="hidden", pld_plus_max_tokens=8)}


@pytest.mark.parametrize("drafter", ["pld", "pld-plus"])
def test_prompt_lookup_drafters_are_exact(engines, pld_engines, drafter):
    batch = prompts(5, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)] * len(batch)
    reference = run_to_completion(engines["none"], batch, params)
    outputs = run_to_completion(pld_engines[drafter], batch, params)
    assert sum(o.spec.num_accepted_tokens for o in outputs.values()) > 0, "the test must exercise speculation"
    for i, prompt in enumerate(batch):
        ref, out = reference[f"req-{i}"].new_token_ids, outputs[f"req-{i}"].new_token_ids
        assert divergence_verdict(engines["none"].runner.model, prompt, ref, out) != "mismatch", (drafter, i)


def test_pld_plus_state_memory_is_reported_bounded_and_freed_when_requests_and_sessions_end(pld_engines):
    engine = pld_engines["pld-plus"]
    stats = []
    run_to_completion(
        engine, prompts(3, seed=8), [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3, stats
    )
    assert max(s.drafter_state_bytes for s in stats) > 0
    assert engine.speculation.drafter.state_bytes() == 0  # every request ended; only cached sessions keep states
    kept, sessions = engine.speculation.state_bytes(), engine.scheduler.sessions
    num_sessions = sessions.num_sessions  # these three conversations' and the earlier tests'
    assert kept > 0 and len(engine.speculation.session_states) == num_sessions >= 3
    assert stats[-1].session_host_bytes == sessions.host_bytes() + kept  # reported: histories and drafter states
    bound, engine.max_session_host_bytes = engine.max_session_host_bytes, stats[-1].session_host_bytes // 2
    try:
        held = engine._bound_session_memory()
        assert 0 < held <= engine.max_session_host_bytes and sessions.num_sessions < num_sessions  # least recent went
    finally:
        engine.max_session_host_bytes = bound
    sessions.reclaim(engine.scheduler.blocks.num_blocks)  # evict every cached session
    engine.speculation.forget_sessions(sessions.take_evicted_keys())
    assert engine.speculation.state_bytes() == 0 and sessions.host_bytes() == 0


def test_cached_sessions_never_hold_more_host_memory_than_the_bound(tiny_model_dir):
    """Long conversations one after another, with copyspec's per-session index: the sessions' host memory stays
    within --session-host-memory after every step, the oldest giving way."""
    from scheduler.config import SessionConfig

    bound_mib = 0.05
    engine = Engine(EngineConfig(
        model=ModelConfig(model=tiny_model_dir, device="cpu"), spec=SpecConfig(drafter="copyspec", copy_gamma=2),
        sessions=SessionConfig(host_memory_mib=bound_mib),
    ))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    held = []
    for i, prompt in enumerate(prompts(12, seed=11)):
        engine.add_request(EngineRequest(f"conversation-{i}", prompt * 2, params))
        while engine.has_work:
            held.append(engine.step().stats.session_host_bytes)
            assert engine.scheduler.sessions.host_bytes() + engine.speculation.session_state_bytes() == held[-1]
    assert max(held) <= bound_mib * 2**20
    assert max(held) > bound_mib * 2**20 / 2 and engine.scheduler.sessions.num_sessions < 12  # it filled, then evicted


def test_a_pld_plus_request_that_cannot_resume_its_state_computes_its_cached_prefix_again(pld_engines):
    """Positions whose KV comes from a cached session need hidden states too: without the session's drafter state
    (another conversation's shared prefix, say) the prefix is recomputed, and the drafter observes it."""
    engine = pld_engines["pld-plus"]
    system = [1] + list(range(10, 40))  # a prefix longer than a KV block, shared by two conversations
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    run_to_completion(engine, [system + [41, 42]], params)
    engine.add_request(EngineRequest("other", system + [43, 44, 45], params[0]))
    req = next(r for r in engine.scheduler.waiting if r.request_id == "other")
    assert req.num_cached_tokens == 0 and req.num_computed_tokens == 0
    while engine.has_work:
        engine.step()


def test_objects_frozen_after_start_up_are_out_of_full_collections_and_the_exit_is_clean(tiny_model_dir):
    # in a process of its own: what is frozen is never collected, and the test process keeps building engines
    script = f"""
import gc
from tests.engine.test_engine import make_engine
from engine.engine import freeze_start_up_objects
engine = make_engine({tiny_model_dir!r}, "copyspec")
cycle = []
cycle.append(cycle)
del cycle  # start-up's garbage: collected, not frozen
freeze_start_up_objects()
assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()
assert len(gc.get_objects()) < 1_000  # what a full collection still walks
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr  # handed back at exit: the teardown frees them
