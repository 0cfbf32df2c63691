"""How many tokens requests draft with a model: the batch's depth by expected goodput, blocks reserved for them."""
import pytest

from drafters.base import Draft
from engine.wire import SamplingParams
from scheduler.acceptance import TreeAcceptance
from scheduler.kv_blocks import KVBlockManager
from scheduler.model_drafts import (
    DRAFTS_TRUSTED,
    EXPLORE_SHARE,
    KEEP_OFF_STEPS,
    MIN_EXPLORE_SHARE,
    PROBE_REQUESTS,
    ModelDraftBudget,
    best_draft_depth,
)
from scheduler.request import Request


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def linear(per_token: float, fixed: float):
    return lambda num_tokens: fixed + per_token * num_tokens


def step(target, draft, batch: int, rest_tokens: int = 0):
    """A step's seconds by depth when BATCH requests draft, beside REST_TOKENS verified for the rest of the batch."""
    return lambda depth: target(rest_tokens + batch * (1 + depth)) + depth * draft(batch)


def test_a_cheap_draft_that_is_often_accepted_drafts_deep():
    # verifying costs little more than decoding; drafting is a tenth of a forward; 90% acceptance
    assert best_draft_depth([0.9 ** i for i in range(1, 6)], 4, step(linear(0.001, 0.1), linear(0.0001, 0.01), 4)) == 5


def test_a_draft_that_costs_a_target_forward_is_turned_off():
    assert best_draft_depth([0.6 ** i for i in range(1, 6)], 4, step(linear(0.001, 0.1), linear(0.001, 0.1), 4)) == 0


def test_depth_stops_where_acceptance_no_longer_pays_for_the_verified_tokens():
    # each verified token costs 10% of a forward: the first few pay, the unlikely last ones do not
    depth = best_draft_depth([0.8, 0.5, 0.2, 0.05, 0.01], 1, step(linear(0.01, 0.1), linear(0.0, 0.001), 1))
    assert 1 <= depth < 5


def test_a_draft_that_pays_for_one_request_alone_does_not_pay_for_a_step_it_delays_for_many():
    path_probs, target, draft = [0.7 ** i for i in range(1, 6)], linear(0.001, 0.02), linear(0.0005, 0.005)
    assert best_draft_depth(path_probs, 1, step(target, draft, 1)) > 0
    # beside 30 copying requests verifying 150 tokens for 83 expected: its gain is small against their delay
    assert best_draft_depth(path_probs, 1, step(target, draft, 1, rest_tokens=150), rest_expected=83.0) == 0


def budget(planned: bool, rate: float = 0.5, draft=linear(0.0005, 0.05)):
    """A draft forward costs half a target forward unless DRAFT says otherwise."""
    estimator = TreeAcceptance(rate, 1e6)  # the prior, unmoved
    blocks = KVBlockManager(num_blocks=8, block_size=4)
    target = linear(0.001, 0.1)
    return ModelDraftBudget(estimator, blocks, 1024, target if planned else None, draft if planned else None), blocks


def decoding_request(request_id: str, num_tokens: int, blocks: KVBlockManager) -> Request:
    req = Request(request_id, list(range(3, 3 + num_tokens)), params(max_tokens=50))
    req.num_computed_tokens = num_tokens - 1
    blocks.grow(request_id, num_tokens)
    return req


def test_without_the_planner_every_request_drafts_the_most_and_gets_its_blocks():
    model_drafts, blocks = budget(planned=False)
    req = decoding_request("a", 6, blocks)  # 5 computed, one block and a half
    assert model_drafts.reserve([req], 5, "draft") == {"a": 5}
    assert len(blocks.block_tables["a"]) == 3  # positions 5..9 drafted: 10 positions


def test_drafts_are_cut_to_the_free_blocks_and_the_tokens_a_request_may_still_generate():
    model_drafts, blocks = budget(planned=False)
    hog = decoding_request("hog", 26, blocks)  # 7 blocks
    req = decoding_request("a", 3, blocks)  # the last block: positions 0..3
    assert model_drafts.reserve([req], 5, "draft") == {"a": 2}  # positions 2 and 3
    short = Request("short", [5, 6, 7], params(max_tokens=3))
    short.all_token_ids += [8, 9]  # two of its three tokens generated: the bonus token is its last
    short.num_computed_tokens = 4
    assert model_drafts.reserve([short, hog], 5, "draft")["short"] == 0


def test_the_planner_turns_a_useless_draft_model_off_but_keeps_measuring_it_less_and_less_often():
    model_drafts, blocks = budget(planned=True, rate=0.05)
    req = decoding_request("a", 6, blocks)
    # a draft forward costs half a step and would pay were it accepted often, but 5% are: a one-token probe after
    # 1 / 2 share steps off, the share halving from EXPLORE_SHARE after every probe that leaves drafting off, down to
    # MIN_EXPLORE_SHARE
    depths = [model_drafts.reserve([req], 5, "draft")["a"] for _ in range(1125)]
    assert set(depths) == {0, 1}
    probes = [step + 1 for step, depth in enumerate(depths) if depth]
    gaps = [after - before for before, after in zip([0, *probes], probes)]
    # 25 .. 200, 250s
    assert gaps == [round(2 ** i / EXPLORE_SHARE / 2) for i in range(4)] + [round(1 / MIN_EXPLORE_SHARE / 2)] * 3
    model_drafts.estimator.prior, model_drafts.draft_seconds = 0.99, linear(0.0001, 0.001)  # right and cheap now
    assert model_drafts.reserve([req], 5, "draft")["a"] > 0


def test_a_probe_drafts_for_a_sample_of_the_batch_the_same_requests_while_they_last():
    # a probe's cost is mostly the model reading what it missed of each request it drafts for: at a batch of 40 it
    # drafts for PROBE_REQUESTS of them, the next probe for the same ones, one that finished replaced by another
    model_drafts, _ = budget(planned=True, rate=0.05)
    blocks = model_drafts.blocks = KVBlockManager(num_blocks=400, block_size=4)
    reqs = [decoding_request(f"r{i}", 6, blocks) for i in range(40)]

    def next_probe(batch: list[Request]) -> set[str]:
        while True:
            depths = model_drafts.reserve(batch, 5, "draft")
            if any(depths.values()):
                return {request_id for request_id, depth in depths.items() if depth}

    first = next_probe(reqs)
    assert len(first) == PROBE_REQUESTS
    gone = sorted(first)[0]
    second = next_probe([req for req in reqs if req.request_id != gone])
    assert len(second) == PROBE_REQUESTS and first - second == {gone}


def test_a_model_that_knows_its_acceptance_gathers_its_first_drafts_from_a_sample_of_the_batch():
    model_drafts, _ = budget(planned=True, rate=0.5)
    blocks = model_drafts.blocks = KVBlockManager(num_blocks=400, block_size=4)
    reqs = [decoding_request(f"r{i}", 6, blocks) for i in range(40)]
    depths = model_drafts.reserve(reqs, 5, "draft", knows_acceptance=True)
    assert sorted(depths.values()) == [0] * (40 - PROBE_REQUESTS) + [5] * PROBE_REQUESTS


def test_a_probe_is_budgeted_at_what_the_last_one_took():
    # a probe's first forward reads every token the model missed while off: measured at four steady rounds, the next
    # probe waits four times as long (200 steps at the halved share, not 50)
    model_drafts, blocks = budget(planned=True, rate=0.05)
    req = decoding_request("a", 6, blocks)
    gaps = []
    for _ in range(2):
        depths = [model_drafts.reserve([req], 5, "draft")["a"]]
        while not depths[-1]:
            depths.append(model_drafts.reserve([req], 5, "draft")["a"])
        gaps.append(len(depths))
        model_drafts.observe_drafting_seconds(4 * 0.0505, [20])
    assert gaps == [round(0.5 / EXPLORE_SHARE), round(4 * 0.5 / (EXPLORE_SHARE / 2))]


def test_an_off_decision_holds_for_its_batch_until_a_probe_or_its_steps_run_out():
    model_drafts, blocks = budget(planned=True, rate=0.05)
    estimates = []
    estimate = model_drafts.estimator.estimate
    model_drafts.estimator.estimate = lambda req, draft: estimates.append(req.request_id) or estimate(req, draft)
    a, b = decoding_request("a", 6, blocks), decoding_request("b", 6, blocks)
    depths = [model_drafts.reserve([a], 5, "draft")["a"] for _ in range(1 + KEEP_OFF_STEPS)]
    assert depths == [0] * (1 + KEEP_OFF_STEPS) and estimates == ["a"]  # decided once, then held
    model_drafts.reserve([a], 5, "draft")
    assert estimates == ["a", "a"]  # its steps ran out: decided again
    model_drafts.reserve([a, b], 5, "draft")
    assert estimates[2:] == ["a", "b"]  # another batch: decided afresh
    while model_drafts.reserve([a, b], 5, "draft")["a"] == 0:
        pass
    decided = len(estimates)
    model_drafts.reserve([a, b], 5, "draft")
    assert len(estimates) == decided + 2  # a probe's outcome moves the estimates: the step after it decides afresh


@pytest.mark.parametrize("copying_beside", [False, True])  # off, then never (the copies leave no room to gain)
def test_a_step_an_off_decision_holds_for_prices_nothing(copying_beside):
    # the latency models, the rest of the batch's verification plan and the probe's price are what the decision
    # rested on, unchanged while it holds: a resting model's step only counts towards its next probe
    model_drafts, blocks = budget(planned=True, rate=0.05)
    priced = []
    target = model_drafts.target_seconds
    model_drafts.target_seconds = lambda num_tokens: priced.append(num_tokens) or target(num_tokens)
    a = decoding_request("a", 6, blocks)
    beside = [(decoding_request("c", 6, blocks), Draft([7, 8], "copyspec"))] if copying_beside else []
    assert model_drafts.reserve([a], 5, "draft", beside)["a"] == 0
    decided, steps_off = len(priced), model_drafts.steps_off
    assert [model_drafts.reserve([a], 5, "draft", beside)["a"] for _ in range(KEEP_OFF_STEPS)] == [0] * KEEP_OFF_STEPS
    assert decided and len(priced) == decided
    assert model_drafts.steps_off == (0 if copying_beside else steps_off + KEEP_OFF_STEPS)


def test_a_draft_that_would_not_pay_even_if_always_accepted_is_never_probed():
    # a draft forward costs a target forward: no acceptance makes drafting pay, so measuring it would only cost time
    model_drafts, blocks = budget(planned=True, rate=0.99, draft=linear(0.001, 0.1))
    req = decoding_request("a", 6, blocks)
    assert {model_drafts.reserve([req], 5, "draft")["a"] for _ in range(2000)} == {0}
    # drafting was once measured slower than the profile: that learnt overhead does not rule the draft out for good
    model_drafts.draft_seconds, model_drafts.draft_overhead_seconds = linear(0.0005, 0.05), 0.1
    depths = [model_drafts.reserve([req], 5, "draft")["a"] for _ in range(200)]
    assert 1 in depths


def test_the_rest_of_the_batch_with_its_drafts_can_turn_the_model_draft_off():
    blocks = KVBlockManager(num_blocks=64, block_size=4)
    model_drafts = ModelDraftBudget(TreeAcceptance(0.7, 1e6), blocks, 1024, linear(0.001, 0.02), linear(0.0005, 0.005))
    req = decoding_request("a", 6, blocks)
    assert model_drafts.reserve([req], 5, "draft")["a"] > 0
    blocks.free("a")
    req = decoding_request("a", 6, blocks)
    copying = [decoding_request(f"c{i}", 6, blocks) for i in range(30)]
    beside = [(other, Draft([7, 8, 9, 10], "copyspec")) for other in copying]
    assert model_drafts.reserve([req], 5, "draft", beside)["a"] == 0


def test_the_drafts_real_cost_is_learnt_from_measured_drafting_time():
    # the profile says drafting is cheap, but each draft forward takes 0.2 s: twice a target forward
    blocks = KVBlockManager(num_blocks=8, block_size=4)
    model_drafts = ModelDraftBudget(TreeAcceptance(0.9, 1e6), blocks, 1024, linear(0.001, 0.1), linear(0.0001, 0.001))
    req = decoding_request("a", 6, blocks)
    depths = []
    for _ in range(60):
        depths.append(model_drafts.reserve([req], 5, "draft")["a"])
        blocks.free("a")
        blocks.grow("a", 6)
        model_drafts.observe_drafting_seconds(0.2 * depths[-1], [1] * depths[-1])
    assert depths[0] == 5 and depths[-1] == 0
    assert 0.1 < model_drafts.draft_overhead_seconds < 0.2
    learnt = model_drafts.draft_overhead_seconds
    model_drafts.reserve([], 5, "draft")  # every request copied: the time measured was not the draft model's
    model_drafts.observe_drafting_seconds(0.01, [])
    assert model_drafts.draft_overhead_seconds == learnt


def test_a_round_that_reads_many_unread_tokens_first_teaches_no_overhead():
    # after a stretch off, the round's first forward reads 150 tokens the model had not read, then drafts 2 more: it
    # computes one row of logits where the profile prices 150, so the round takes a fraction of its price, and its
    # error would teach a negative overhead that prices steady drafting at nothing
    blocks = KVBlockManager(num_blocks=8, block_size=4)
    draft = linear(0.0001, 0.001)
    model_drafts = ModelDraftBudget(TreeAcceptance(0.9, 1e6), blocks, 1024, linear(0.001, 0.1), draft)
    req = decoding_request("a", 6, blocks)
    model_drafts.reserve([req], 5, "draft")
    model_drafts.observe_drafting_seconds(0.2 * draft(150) + 2 * draft(1), [150, 1, 1])
    assert model_drafts.draft_overhead_seconds == 0.0
    # a steady round (its first forward rereads what the last step accepted, 6 tokens at most) teaches: 3 ms over
    # three forwards of one chain each, 1 ms a chain
    model_drafts.observe_drafting_seconds(draft(6) + 2 * draft(1) + 0.003, [6, 1, 1])
    assert abs(model_drafts.draft_overhead_seconds - 0.001) < 1e-12


def sampled_request(request_id: str, num_tokens: int, blocks: KVBlockManager) -> Request:
    req = Request(request_id, list(range(3, 3 + num_tokens)), SamplingParams(temperature=1.0, max_tokens=50))
    req.num_computed_tokens = num_tokens - 1
    blocks.grow(request_id, num_tokens)
    return req


def test_a_model_that_knows_its_acceptance_drafts_greedy_requests_as_deep_as_allowed_once_it_drafts():
    # a draft forward costs half a step: chains of a 50 % rate do not pay, so a sampled request (whose drafts carry no
    # estimates) drafts nothing; a greedy one drafts while the model has too few drafts of its own to weigh
    model_drafts, blocks = budget(planned=True, rate=0.5)
    greedy, sampled = decoding_request("a", 6, blocks), sampled_request("b", 6, blocks)
    assert model_drafts.reserve([sampled], 5, "draft", knows_acceptance=True) == {"b": 0}
    assert model_drafts.reserve([greedy], 5, "draft", knows_acceptance=True) == {"a": 5}
    assert model_drafts.reserve([greedy], 5, "draft") == {"a": 0}  # a model without estimates: the chains' rate


def test_its_recent_drafts_estimates_decide_whether_a_model_that_knows_its_acceptance_drafts():
    for estimate, drafts in [(0.05, False), (0.95, True)]:
        model_drafts, blocks = budget(planned=True, rate=0.5)
        req = decoding_request("a", 6, blocks)
        model_drafts.reserve([req], 5, "draft", knows_acceptance=True)
        for _ in range(DRAFTS_TRUSTED):
            model_drafts.observe_draft(Draft([7, 8], "draft", acceptance=[estimate, 0.9]))
            model_drafts.observe_draft(Draft([7], "copy", acceptance=[1 - estimate]))  # another source's: not kept
        # each node verified only where it pays for its row gains max(0, P - r) tokens, against half a step a forward
        assert (model_drafts.reserve([req], 5, "draft", knows_acceptance=True)["a"] > 0) == drafts


def test_a_tree_is_priced_at_the_forwards_that_grew_it_not_the_depth_it_kept():
    # a draft of two tokens pays for its two forwards; the same nodes kept from a tree grown four deep do not
    decisions = []
    for forwards in (0, 4):
        model_drafts, blocks = budget(planned=True, rate=0.5)
        req = decoding_request("a", 6, blocks)
        model_drafts.reserve([req], 5, "draft", knows_acceptance=True)
        for _ in range(DRAFTS_TRUSTED):
            model_drafts.observe_draft(Draft([7, 8], "draft", acceptance=[0.9, 0.9], forwards=forwards))
        decisions.append(model_drafts.reserve([req], 5, "draft", knows_acceptance=True)["a"] > 0)
    assert decisions == [True, False]


def test_a_rounds_chains_go_on_while_the_likeliest_together_pay_for_the_next_forward():
    # a forward costs 30 ms and 20 ms more a chain (a step 101 ms): a 0.9 path alone gains less than a forward,
    # with the 0.5 one beside it more than the forward of two; the 0.1 one adds less than its share
    model_drafts, blocks = budget(planned=True, rate=0.5, draft=linear(0.02, 0.03))
    req = decoding_request("a", 6, blocks)
    assert model_drafts.continuing([0.9, 0.1, 0.5]) == [True] * 3  # no round priced: the chains run to their budget
    model_drafts.reserve([req], 5, "draft", knows_acceptance=True)  # drafting, its drafts not weighed yet
    assert model_drafts.continuing([0.9, 0.1, 0.5]) == [True, False, True]
    assert model_drafts.continuing([0.3]) == [False]
    model_drafts.reserve([req], 5, "draft")  # a model without estimates: its chains are not cut short
    assert model_drafts.continuing([0.3]) == [True]


def test_a_probe_of_a_model_that_knows_its_acceptance_drafts_afresh_until_its_drafts_decide_again():
    model_drafts, blocks = budget(planned=True, rate=0.5)
    req = decoding_request("a", 6, blocks)

    def step() -> int:
        depth = model_drafts.reserve([req], 5, "draft", knows_acceptance=True)["a"]
        blocks.free("a")
        blocks.grow("a", 6)
        if depth:
            model_drafts.observe_draft(Draft([7, 8], "draft", acceptance=[0.05, 0.5]))  # never worth its forward
        return depth

    depths = [step() for _ in range(DRAFTS_TRUSTED + 1)]
    assert depths == [5] * DRAFTS_TRUSTED + [0]  # drafted to gather its estimates, then turned off by them
    gaps, off = [], 0
    while len(gaps) < 3:
        if step():
            gaps.append(off)
            assert [step() for _ in range(DRAFTS_TRUSTED)] == [5] * (DRAFTS_TRUSTED - 1) + [0]  # fresh drafts decide
            off = 0
        else:
            off += 1
    # a probe is priced at the DRAFTS_TRUSTED rounds it drafts, and the probes' share halves as they leave it off
    assert gaps[1] > 1.8 * gaps[0] and gaps[2] > 1.8 * gaps[1]


def test_a_draft_models_overhead_is_learnt_per_chain_so_a_larger_batch_is_priced_by_its_chains():
    # the drafter's own work takes 1 ms per request a forward carries, beyond a profile that knows nothing of it
    blocks = KVBlockManager(num_blocks=64, block_size=4)
    draft = linear(0.0001, 0.001)
    model_drafts = ModelDraftBudget(TreeAcceptance(0.9, 1e6), blocks, 1024, linear(0.001, 0.1), draft)
    reqs = [decoding_request(f"r{i}", 6, blocks) for i in range(16)]
    for _ in range(200):
        model_drafts.reserve(reqs, 2, "draft")
        model_drafts.observe_drafting_seconds(draft(20) + draft(16) + 32 * 0.001, [20, 16])  # 16 chains in each
    assert abs(model_drafts.draft_overhead_seconds - 0.001) < 1e-5
    assert abs(model_drafts._drafting_seconds(1, 16) - (draft(16) + 0.016)) < 2e-4
    assert abs(model_drafts._drafting_seconds(1, 1) - (draft(1) + 0.001)) < 1e-5


def test_a_companion_model_is_priced_once_over_the_drafted_tokens_and_a_companion_head_at_each_forward():
    """A companion model scores every drafted token in one forward after drafting; a companion head runs beside each
    of the draft head's forwards (drafters/head_draft.py), so d forwards of B tokens, each with its fixed cost."""
    blocks = KVBlockManager(num_blocks=64, block_size=16)
    companion = linear(0.001, 0.01)
    once = ModelDraftBudget(TreeAcceptance(0.9, 1e6), blocks, 1024, linear(0.001, 0.1), linear(0.0001, 0.001),
                            companion)
    lockstep = ModelDraftBudget(TreeAcceptance(0.9, 1e6), blocks, 1024, linear(0.001, 0.1), linear(0.0001, 0.001),
                                companion, companion_in_lockstep=True)
    draft = 3 * (0.001 + 0.0001 * 4)
    assert once._drafting_seconds(3, 4) == pytest.approx(draft + companion(12))
    assert lockstep._drafting_seconds(3, 4) == pytest.approx(draft + 3 * companion(4))
    assert lockstep._drafting_seconds(0, 4) == 0.0
