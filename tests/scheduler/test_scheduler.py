import pytest

from drafters.base import Draft
from engine.wire import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.kv_blocks import KVBlockManager
from scheduler.latency import LatencyModel
from scheduler.records import Verification
from scheduler.request import Request
from scheduler.scheduler import QueueFullError, Scheduler

EOS = 2
BLOCK_SIZE = 4


def make_scheduler(
    planner=False, max_waiting=8, max_model_len=64, num_blocks=64, budget=512, max_num_seqs=2, draft_latency=None,
):
    latency = LatencyModel({1: 1.0, 16: 1.0}) if planner else None  # flat latency: drafts are free
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_waiting=max_waiting, use_goodput_planner=planner
    )
    blocks = KVBlockManager(num_blocks, BLOCK_SIZE)
    return Scheduler(config, max_model_len, [EOS], blocks, latency, draft_latency=draft_latency)


def step(scheduler, out, sampled):
    """Update after a step whose chain drafts were verified: each list is the accepted drafts, then one more token."""
    update = scheduler.update(out, [Verification(tokens, list(range(max(len(tokens) - 1, 0)))) for tokens in sampled])
    return update.updates, update.stats


def add(scheduler, request_id="r", prompt=(5, 6, 7), max_tokens=10, ignore_eos=False):
    req = Request(
        request_id, list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    )
    scheduler.add_request(req)
    return req


def test_prefill_then_decode_with_drafts_keeps_computed_tokens_in_step():
    scheduler = make_scheduler()
    req = add(scheduler)
    out = scheduler.schedule()
    assert out.scheduled[0].token_ids == [5, 6, 7] and out.scheduled[0].num_draft_tokens == 0
    step(scheduler, out, [[8]])
    assert req.all_token_ids == [5, 6, 7, 8] and req.num_computed_tokens == 3
    scheduler.set_drafts([req], [Draft([9, 10, 11], "copyspec")])
    out = scheduler.schedule()
    assert out.scheduled[0].token_ids == [8, 9, 10, 11]
    assert out.scheduled[0].draft_token_ids == [9, 10, 11]
    outputs, stats = step(scheduler, out, [[9, 12]])  # first draft accepted, then the bonus token
    assert outputs[0].new_token_ids == [9, 12]
    assert req.num_computed_tokens == 5  # 8 and 9 are in the cache; 12 is not yet
    assert (req.spec.num_drafts, req.spec.num_draft_tokens, req.spec.num_accepted_tokens) == (1, 3, 1)
    assert (stats.num_offered_draft_tokens, stats.num_verified_draft_tokens, stats.num_accepted_tokens) == (3, 3, 1)
    copy_stats = stats.spec_by_drafter["copyspec"]
    assert (copy_stats.num_drafts, copy_stats.num_draft_tokens, copy_stats.num_accepted_tokens) == (1, 3, 1)
    assert copy_stats.num_accepted_per_position == [1, 0, 0]
    assert stats.num_generated_tokens == 2


def test_planner_reports_expected_tokens_and_predicted_seconds():
    scheduler = make_scheduler(planner=True)
    req = add(scheduler)
    out = scheduler.schedule()
    assert (out.expected_tokens, out.predicted_seconds) == (1.0, 1.0)  # prefill: one token, flat latency
    step(scheduler, out, [[8]])
    scheduler.set_drafts([req], [Draft([9, 10], "copyspec")])
    out = scheduler.schedule()
    assert out.scheduled[0].num_draft_tokens == 2  # flat latency: drafts are free
    assert out.expected_tokens == pytest.approx(1 + 0.5 + 0.25)  # prior acceptance 0.5 per position
    _, stats = step(scheduler, out, [[9, 10, 11]])
    assert (stats.planned_tokens, stats.planned_seconds) == (pytest.approx(1.75), 1.0)


def test_drafts_are_cut_to_the_tokens_left():
    scheduler = make_scheduler()
    req = add(scheduler, max_tokens=3)
    step(scheduler, scheduler.schedule(), [[8]])
    scheduler.set_drafts([req], [Draft([1, 1, 1, 1], "copyspec")])
    assert scheduler.schedule().scheduled[0].num_draft_tokens == 1  # 2 tokens left: 1 draft + 1 bonus


def test_stops_at_eos_and_drops_tokens_after_it():
    scheduler = make_scheduler()
    req = add(scheduler)
    step(scheduler, scheduler.schedule(), [[8]])
    scheduler.set_drafts([req], [Draft([EOS, 9], "copyspec")])
    outputs, _ = step(scheduler, scheduler.schedule(), [[EOS, 9, 4]])
    assert outputs[0].new_token_ids == [EOS]
    assert outputs[0].finish_reason == "stop" and outputs[0].spec is not None
    assert not scheduler.has_work


def test_ignore_eos_and_max_tokens_give_length():
    scheduler = make_scheduler()
    add(scheduler, max_tokens=2, ignore_eos=True)
    step(scheduler, scheduler.schedule(), [[EOS]])
    outputs, _ = step(scheduler, scheduler.schedule(), [[EOS]])
    assert outputs[0].finish_reason == "length"


def test_context_limit_gives_length():
    scheduler = make_scheduler(max_model_len=4)
    add(scheduler, max_tokens=100)
    outputs, _ = step(scheduler, scheduler.schedule(), [[8]])
    assert outputs[0].finish_reason == "length"


def test_queue_bound_and_abort():
    scheduler = make_scheduler(max_waiting=1)
    add(scheduler, "a")
    with pytest.raises(QueueFullError):
        add(scheduler, "b")
    assert scheduler.abort("a").finish_reason == "abort"
    assert scheduler.abort("a") is None
    assert not scheduler.has_work


def test_running_is_bounded_and_waiting_requests_join_when_one_finishes():
    scheduler = make_scheduler()
    for name in "abc":
        add(scheduler, name, max_tokens=1)
    out = scheduler.schedule()
    assert [item.req.request_id for item in out.scheduled] == ["a", "b"]
    step(scheduler, out, [[8], [8]])
    assert [item.req.request_id for item in scheduler.schedule().scheduled] == ["c"]


def test_planner_drops_drafts_that_will_fail():
    scheduler = make_scheduler(planner=True)
    req = add(scheduler, max_tokens=100)
    step(scheduler, scheduler.schedule(), [[8]])
    for _ in range(30):  # every draft is rejected at its first token
        scheduler.set_drafts([req], [Draft([1, 1, 1], "copyspec")])
        out = scheduler.schedule()
        step(scheduler, out, [[3]])
    scheduler.set_drafts([req], [Draft([1, 1, 1], "copyspec")])
    latency = LatencyModel({1: 1.0, 2: 1.5, 4: 2.5})
    scheduler.latency = latency
    assert scheduler.schedule().scheduled[0].num_draft_tokens == 0


def test_planner_resumes_verifying_a_drafter_whose_unverified_drafts_turn_right():
    """Estimates learn from every draft, verified or not (the target's own tokens score it), so a drafter the
    planner stopped verifying is taken up again as soon as its drafts start matching, without probe steps."""
    scheduler = make_scheduler(planner=True, max_model_len=1024, num_blocks=256)
    scheduler.latency = LatencyModel({1: 1.0, 2: 1.3, 4: 1.9})  # a draft is worth verifying above 30% acceptance
    req = add(scheduler, max_tokens=1000, ignore_eos=True)
    step(scheduler, scheduler.schedule(), [[8]])
    for _ in range(20):  # drafts that always fail: the planner soon stops verifying them
        scheduler.set_drafts([req], [Draft([1, 1, 1], "copyspec")])
        step(scheduler, scheduler.schedule(), [[3]])
    verified = []
    for _ in range(20):  # now the drafted first token is always the target's next token
        scheduler.set_drafts([req], [Draft([9, 10, 11], "copyspec")])
        out = scheduler.schedule()
        num_drafts = out.scheduled[0].num_draft_tokens
        verified.append(num_drafts)
        step(scheduler, out, [[9, 10, 11, 12][:num_drafts + 1]])  # unverified, 9 still comes out as the target's token
    assert verified[:2] == [0, 0], "the failed drafts had shut verification off"
    # after 20 misses, (hits + prior) / (tries + prior) passes 0.3 after ~8 hits: no probe step was needed for it
    assert 0 < verified.index(next(n for n in verified if n > 0)) <= 10
    assert all(n > 0 for n in verified[-8:]), "unverified drafts that matched brought verification back"


def test_the_planner_stops_verifying_tokens_whose_own_estimates_promise_more_than_they_accept():
    """A drafter that prices its own tokens (Draft.acceptance) too high: what its verified tokens accept corrects
    the estimates the planner weighs (scheduler/acceptance.py's CalibratedEstimator), for greedy requests here."""
    scheduler = make_scheduler(planner=True, max_model_len=1024, num_blocks=256)
    scheduler.latency = LatencyModel({1: 1.0, 2: 1.3, 4: 1.9})  # a token is worth verifying above ~30% acceptance
    req = add(scheduler, max_tokens=1000, ignore_eos=True)
    step(scheduler, scheduler.schedule(), [[8]])
    verified = []
    for _ in range(40):
        scheduler.set_drafts([req], [Draft([1], "spectra", acceptance=[0.6])])
        out = scheduler.schedule()
        verified.append(out.scheduled[0].num_draft_tokens)
        step(scheduler, out, [[3]])  # never accepted
    assert verified[0] == 1 and verified[-1] == 0
    assert scheduler.estimator.factor("spectra", False) < 0.5
    assert scheduler.estimator.factor("spectra", True) == 1.0


def test_prefill_steps_do_not_teach_the_step_overhead():
    scheduler = make_scheduler(planner=True)
    scheduler.latency = LatencyModel({1: 1.0, 64: 10.0})
    add(scheduler, prompt=list(range(3, 40)), max_tokens=10)
    prefill = scheduler.schedule()
    assert prefill.has_prefill
    scheduler.observe_step_seconds(prefill, 0.5)  # a short-context prefill runs far faster than the profile's point
    assert scheduler.step_overhead(1) == 0.0
    step(scheduler, prefill, [[8]])
    decode = scheduler.schedule()
    assert not decode.has_prefill
    scheduler.observe_step_seconds(decode, 2.0)
    assert scheduler.step_overhead(1) == pytest.approx(0.1 * 1.0)


def test_the_overhead_of_a_full_batch_does_not_price_the_steps_of_its_last_request():
    # the profile says 1 s a step; a draft forward costs 1.5 s, more than a step of one request
    scheduler = make_scheduler(
        planner=True, max_num_seqs=8, max_model_len=128, num_blocks=256, draft_latency=LatencyModel({1: 1.5}),
    )
    reqs = [add(scheduler, f"r{i}", max_tokens=100) for i in range(8)]
    step(scheduler, scheduler.schedule(), [[8]] * 8)
    for _ in range(40):  # a step of 8 takes 5 s more than the profile (attention over 8 contexts, say)
        out = scheduler.schedule()
        scheduler.observe_step_seconds(out, 6.0)
        step(scheduler, out, [[9]] * 8)
    assert scheduler.step_overhead(8) == pytest.approx(5.0, rel=0.02)
    # beside a 6 s step, a 1.5 s draft the target accepts half the time pays
    assert scheduler.reserve_model_drafts(reqs, 5, "draft")["r0"] > 0
    for req in reqs[1:]:
        scheduler.abort(req.request_id)
    for _ in range(40):  # the last request's steps take what the profile says
        out = scheduler.schedule()
        scheduler.observe_step_seconds(out, 1.0)
        step(scheduler, out, [[9]])
    assert scheduler.step_overhead(1) < 0.1 and scheduler.step_overhead(8) == pytest.approx(5.0, rel=0.02)
    assert scheduler.schedule().predicted_seconds < 1.1
    # beside its own 1 s step, no acceptance makes the draft pay: it is not even probed
    assert {scheduler.reserve_model_drafts(reqs[:1], 5, "draft")["r0"] for _ in range(2000)} == {0}


def test_a_row_verified_beside_a_prefill_chunk_must_pay_as_in_a_decode_step():
    """A row of 20 % acceptance does not pay in a decode step (0.3 s for 0.2 tokens of a 1 s step); beside a chunk
    of 100 prompt tokens it still must not, though the chunk's 30 s alone leave the step's goodput at 1 / 30.7."""
    scheduler = make_scheduler(planner=True, max_model_len=1024, num_blocks=256)
    scheduler.latency = LatencyModel({1: 1.0, 201: 61.0})  # 0.7 s + 0.3 s per token
    req = add(scheduler, max_tokens=100)
    step(scheduler, scheduler.schedule(), [[8]])
    scheduler.set_drafts([req], [Draft([9], "copyspec", acceptance=[0.2])])
    assert scheduler.schedule().scheduled[0].num_draft_tokens == 0
    add(scheduler, "p", prompt=tuple(range(10, 110)))
    out = scheduler.schedule()
    assert [item.req.request_id for item in out.scheduled] == ["r", "p"] and out.num_scheduled_tokens == 101
    assert out.scheduled[0].num_draft_tokens == 0
    scheduler.set_drafts([req], [Draft([9], "copyspec", acceptance=[0.9])])
    assert scheduler.schedule().scheduled[0].num_draft_tokens == 1  # a row that pays in a decode step pays here


def test_a_tree_draft_is_verified_whole_and_the_accepted_branch_kv_moves_to_its_final_positions():
    scheduler = make_scheduler()  # no planner: every node is verified
    req = add(scheduler)
    step(scheduler, scheduler.schedule(), [[8]])  # prompt 5 6 7 computed; 8 is the last token
    scheduler.set_drafts([req], [Draft([9, 10, 20, 21], "ngram", [-1, 0, -1, 2])])  # rows 9-10 and 20-21
    out = scheduler.schedule()
    item = out.scheduled[0]
    assert item.token_ids == [8, 9, 10, 20, 21] and item.draft_parents == [-1, 0, -1, 2]
    update = scheduler.update(out, [Verification([20, 21, 22], accepted_nodes=[2, 3])])  # the second row was right
    assert req.all_token_ids[-3:] == [20, 21, 22] and req.num_computed_tokens == 6
    table = scheduler.blocks.block_tables["r"]

    def slot(kv_index):
        return table[kv_index // BLOCK_SIZE] * BLOCK_SIZE + kv_index % BLOCK_SIZE

    # 8 sits at KV index 3 and the nodes at 4..7 in list order; 20 and 21 belong at 4 and 5
    assert update.kv_moves == [(slot(6), slot(4)), (slot(7), slot(5))]
    stats = update.stats.spec_by_drafter["ngram"]
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 2)
    assert stats.num_accepted_per_position == [1, 1] and stats.num_accepted_per_rank == [1, 1]


def test_a_chain_needs_no_kv_move():
    scheduler = make_scheduler()
    req = add(scheduler)
    step(scheduler, scheduler.schedule(), [[8]])
    scheduler.set_drafts([req], [Draft([9, 10], "copyspec")])
    update = scheduler.update(scheduler.schedule(), [Verification([9, 10, 11], [0, 1])])
    assert update.kv_moves == [] and req.num_computed_tokens == 6


def test_the_planner_verifies_the_likely_branch_of_a_tree_and_not_its_unlikely_sibling():
    scheduler = make_scheduler(planner=True, max_model_len=1024, num_blocks=256)
    scheduler.latency = LatencyModel({1: 1.0, 2: 1.3, 8: 2.0})
    req = add(scheduler, max_tokens=1000, ignore_eos=True)
    step(scheduler, scheduler.schedule(), [[8]])
    for _ in range(30):  # the first row (9, 10) is always right, the sibling 30 never
        scheduler.set_drafts([req], [Draft([9, 10, 30], "ngram", [-1, 0, -1])])
        out = scheduler.schedule()
        verified = out.scheduled[0].draft_nodes  # draft nodes, listed parents first
        path = [i for i, node in enumerate(verified) if node in (0, 1)]  # their selection indices on the right row
        scheduler.update(out, [Verification([9, 10][:len(path)] + [11], path)])
    scheduler.set_drafts([req], [Draft([9, 10, 30], "ngram", [-1, 0, -1])])
    assert scheduler.schedule().scheduled[0].draft_nodes == [0, 1]


def test_a_later_choice_reads_the_first_choices_prompt_blocks_once_they_are_computed():
    scheduler = make_scheduler(max_num_seqs=4)
    prompt = tuple(range(10, 21))  # 11 tokens: two full blocks of 4, the last token in the third
    first = add(scheduler, "c-0", prompt)
    second = Request("c-1", list(prompt), first.sampling, prompt_source="c-0")
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert [item.req.request_id for item in out.scheduled] == ["c-0"]  # the second waits for the prompt's KV
    step(scheduler, out, [[30]])
    out = scheduler.schedule()
    second_item = next(item for item in out.scheduled if item.req is second)
    assert second_item.num_computed == 8 and second_item.token_ids == list(prompt[8:])
    tables = scheduler.blocks.block_tables
    assert tables["c-1"][:2] == tables["c-0"][:2] and tables["c-1"][2] != tables["c-0"][2]
    assert second.num_cached_tokens == 8


def test_a_later_choice_whose_first_choice_is_gone_computes_the_prompt_itself():
    scheduler = make_scheduler(max_num_seqs=4)
    second = Request("c-1", list(range(10, 21)), SamplingParams(temperature=0.0, max_tokens=4), prompt_source="c-0")
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert out.scheduled[0].req is second and out.scheduled[0].num_computed == 0
