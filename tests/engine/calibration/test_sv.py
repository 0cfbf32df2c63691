"""Speculative Verification's companion: its observations (S, A), the binned acceptance table, its calibration
report, and an engine whose planner weighs model drafts by the companion's estimates."""
import pytest
import torch

from drafters.config import SpecConfig
from drafters.model_draft import overlap_and_acceptance
from engine.artifacts import SvTable, equal_frequency_edges, load_sv_tables, sv_fingerprints, sv_table_path
from engine.calibration.answers import plain_attention
from engine.calibration.sv import brier, calibrate_sv, head_teacher_forced_tokens, information_gain_table
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model.eagle3 import load_eagle3_head
from engine.wire import SamplingParams
from scheduler.config import SchedulerConfig, SessionConfig
from tests.engine.helpers import run_to_completion
from tests.engine.test_engine import prompts


def test_overlap_is_one_minus_total_variation_and_acceptance_is_capped_at_one():
    q = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.8, 0.0]])
    c = torch.tensor([[0.5, 0.5, 0.0], [0.6, 0.2, 0.2]])
    s, a = overlap_and_acceptance(q, c, torch.tensor([0, 1]))
    assert s.tolist() == pytest.approx([1.0, 0.4])
    assert a.tolist() == pytest.approx([1.0, 0.25])


def test_equal_frequency_bins_hold_as_many_values_each():
    values = torch.rand(1000, generator=torch.Generator().manual_seed(0)) ** 3  # dense near 0
    edges = equal_frequency_edges(values, 10)
    counts = torch.bincount(torch.tensor([sum(v > e for e in edges) for v in values.tolist()]))
    assert len(edges) == 9 and counts.min() >= 95 and counts.max() <= 105


def synthetic(num: int, seed: int):
    """Acceptance that follows A closely and S loosely."""
    generator = torch.Generator().manual_seed(seed)
    s, a = torch.rand(num, generator=generator), torch.rand(num, generator=generator)
    accepted = (0.7 * a + 0.2 * s + 0.1 * torch.rand(num, generator=generator)).clamp(0, 1)
    return s, a, accepted


def test_the_table_predicts_better_than_the_mean_and_its_information_gain_is_positive(tmp_path):
    s, a, accepted = synthetic(4000, 0)
    table = SvTable.fit(s, a, accepted)
    test_s, test_a, test_accepted = synthetic(2000, 1)
    estimates = torch.tensor([table.estimate(x, y) for x, y in zip(test_s.tolist(), test_a.tolist())])
    assert brier(estimates, test_accepted) < 0.5 * brier(torch.full_like(estimates, table.mean), test_accepted)
    gain = information_gain_table(test_accepted, test_s, test_a, table)
    assert gain["given_A"] < gain["given_S"] < gain["entropy"] and gain["given_S_and_A"] <= gain["given_A"]
    assert gain["information_gain"] > 0
    table.save(tmp_path / "t.json")
    assert SvTable.load(tmp_path / "t.json").estimate(0.5, 0.5) == table.estimate(0.5, 0.5)


def test_a_sparse_cell_shrinks_toward_the_table_mean_and_observations_move_it():
    s, a, accepted = synthetic(400, 2)
    table = SvTable.fit(s, a, accepted)
    i, j = table.cell(0.99, 0.99)
    table.sums[i][j], table.counts[i][j] = 1.0, 1.0  # one accepted token seen there
    assert table.mean < table.estimate(0.99, 0.99) < 0.5 * (1 + table.mean)
    for _ in range(100):
        table.observe(0.99, 0.99, 0.0)
    assert table.estimate(0.99, 0.99) < 0.1


@pytest.fixture(scope="module")
def sv_engine(tiny_model_dir, tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("sv-cache"))

    def engine(drafter="none", planner=True):
        return Engine(EngineConfig(
            model=ModelConfig(model=tiny_model_dir, device="cpu", cache_dir=cache_dir, draft_model="early-exit:1",
                              companion_model="early-exit:1"),
            cache=CacheConfig(0.05), scheduler=SchedulerConfig(max_num_seqs=8, use_goodput_planner=planner),
            spec=SpecConfig(drafter=drafter, num_draft_tokens=4),
            sessions=SessionConfig(mode="off"),
        ))

    return engine


def test_calibration_fits_a_table_per_model_triple_that_serving_loads_and_uses(sv_engine, tiny_model_dir):
    engine = sv_engine()
    table, report = calibrate_sv(engine, prompts(4, seed=21), max_tokens=24, greedy=True)
    assert (report["num_tokens"] > 0
            and set(report["information_gain"]) >= {"entropy", "given_S_and_A", "information_gain"})
    assert 0.0 <= report["brier_companion"] <= 1.0 and 0.0 <= report["brier_statistical"] <= 1.0
    fingerprints = sv_fingerprints(engine.model_fingerprint, engine.draft_forward, engine.companion_forward)
    table.save(sv_table_path(engine.cache_dir, fingerprints, greedy=True))
    assert set(load_sv_tables(engine.cache_dir, fingerprints)) == {True}

    serving = sv_engine("draft", planner=False)  # every step drafts (the planner may find drafting not worth it)
    drafter = serving.speculation.drafter
    assert set(drafter.tables) == {True}
    batch = prompts(4, seed=22)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * len(batch)
    plain = run_to_completion(
        Engine(EngineConfig(model=ModelConfig(model=tiny_model_dir, device="cpu"), cache=CacheConfig(0.05),
                            spec=SpecConfig(drafter="none"))),
        batch, params,
    )
    seen = []
    original = drafter._companion_estimates
    drafter._companion_estimates = lambda reqs: seen.append(original(reqs)) or seen[-1]
    outputs = run_to_completion(serving, batch, params)
    assert {k: o.new_token_ids for k, o in outputs.items()} == {k: o.new_token_ids for k, o in plain.items()}
    estimates = [value for step in seen for values in step.values() for value in values]
    assert estimates and all(0.0 < value < 1.0 for value in estimates), "the drafts carry the companion's estimates"
    observed = sum(sum(row) for row in drafter.tables[True].counts)
    assert observed > table.meta["num_tokens"], "serving updates the table online"


def test_a_companion_needs_a_draft_model(tiny_model_dir):
    with pytest.raises(ValueError, match="--draft-model"):
        Engine(EngineConfig(model=ModelConfig(model=tiny_model_dir, device="cpu", companion_model="early-exit:1"),
                            cache=CacheConfig(0.05), spec=SpecConfig(drafter="none")))


def test_calibration_of_a_head_and_its_companion_head_fits_the_table_serving_scores_head_drafts_with(
    tiny_model_dir, tiny_head_dir, tiny_companion_head_dir, tmp_path,
):
    """Heads are profiled as they draft: every answer position at depths 1..k, each head reading its own outputs past
    depth 1 (engine/calibration/sv.py); the table then gives the estimates a head's drafts carry, and learns online."""
    from tests.engine.model.test_eagle3 import companion_engine

    engine = companion_engine(tiny_model_dir, tiny_head_dir, tiny_companion_head_dir, cache_dir=str(tmp_path))
    target, layers = engine.runner.model, engine.draft_forward.target_layers
    heads = [load_eagle3_head(path, target.get_input_embeddings(), torch.float32, torch.device("cpu"))
             for path in (tiny_head_dir, tiny_companion_head_dir)]
    with plain_attention((target,)):
        observed = head_teacher_forced_tokens(target, *heads, layers, prompts(1, seed=23)[0], list(range(3, 13)),
                                              SamplingParams(temperature=0.0), None, depth=4)
    # 10 answer tokens, at depths 1..4: a depth-d token is drafted after d - 1 answer tokens accepted
    assert len(observed["S"]) == len(observed["A"]) == len(observed["accepted"]) == 10 + 9 + 8 + 7
    assert set(observed["accepted"].tolist()) <= {0.0, 1.0} and 0.0 <= float(observed["S"].min())
    assert torch.bincount(observed["depth"].long()).tolist() == [0, 10, 9, 8, 7]
    assert 0.0 < float(observed["Q"].min()) and float(observed["Q"].max()) <= 1.0  # the head's probability of each

    table, report = calibrate_sv(engine, prompts(4, seed=23), max_tokens=16, greedy=True)
    assert table.meta["num_tokens"] > 0
    assert all(0.0 <= report[key] <= 1.0 for key in ("brier_statistical_by_depth", "brier_draft_probability"))
    assert 0.0 <= report["brier_companion"] <= 1.0 and 0.0 <= report["brier_statistical"] <= 1.0
    table.save(sv_table_path(engine.cache_dir, sv_fingerprints(
        engine.model_fingerprint, engine.draft_forward, engine.companion_forward), greedy=True))

    serving = companion_engine(tiny_model_dir, tiny_head_dir, tiny_companion_head_dir, cache_dir=str(tmp_path))
    drafter = serving.speculation.drafter
    assert set(drafter.tables) == {True}
    estimates = []
    score = drafter._score
    drafter._score = lambda req, q, logits, token: score(req, q, logits, token) or estimates.append(
        drafter._confidence[req.request_id][-1][0])
    run_to_completion(serving, prompts(2, seed=24),
                      [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2)
    assert estimates and all(0.0 < value < 1.0 for value in estimates), "table estimates, not A (often 0 or 1)"
    assert sum(sum(row) for row in drafter.tables[True].counts) > table.meta["num_tokens"], "learnt online"
