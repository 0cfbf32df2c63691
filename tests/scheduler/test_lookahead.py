"""Look-ahead chains (SPECTRA's candidate pool): carried whole while the budget and KV allow without the planner,
only while they raise the step's expected goodput with it, their rows in the forward after the draft and their
scratch KV given back by the next update."""
from drafters.base import CaptureSpec, Draft
from engine.batching import forward_batch
from scheduler.latency import LatencyModel
from tests.scheduler.test_scheduler import BLOCK_SIZE, add, make_scheduler, step

CHAINS = ((30, 31, 32), (33, 34, 35), (36, 37, 38))


def decoding(scheduler, max_tokens=50):
    req = add(scheduler, max_tokens=max_tokens)
    step(scheduler, scheduler.schedule(), [[8]])
    return req


def test_without_the_planner_every_chain_fits_the_token_budget_and_kv_comes_back():
    scheduler = make_scheduler(budget=9)
    req = decoding(scheduler)
    scheduler.set_drafts([req], [Draft([9, 10], "spectra", lookahead=CHAINS)])
    out = scheduler.schedule()
    item = out.scheduled[0]
    # the last token and 2 drafted tokens leave room for 2 chains of 3 rows in a budget of 9
    assert item.token_ids == [8, 9, 10] and item.lookahead == list(CHAINS[:2]) and out.num_scheduled_tokens == 9
    assert len(scheduler.blocks.block_tables["r"]) * BLOCK_SIZE >= req.num_computed_tokens + 9
    forward = forward_batch(out.scheduled, BLOCK_SIZE, CaptureSpec()).items[0]
    assert forward.token_ids == [8, 9, 10, 30, 31, 32, 33, 34, 35]
    assert forward.parents == [-1, 0, 1, 0, 3, 4, 0, 6, 7]  # each chain hangs off the last token
    assert forward.positions[3:6] == forward.positions[6:9] == [4, 5, 6]
    assert forward.logit_rows == [0, 1, 2] and forward.drafter_rows == [5, 8]
    updates, stats = step(scheduler, out, [[9, 11]])
    assert stats.num_lookahead_rows == 6
    assert len(scheduler.blocks.block_tables["r"]) == -(-(req.num_computed_tokens + 1) // BLOCK_SIZE)


def test_the_planner_carries_chains_only_while_their_yield_pays_for_their_rows():
    scheduler = make_scheduler(planner=True)
    scheduler.latency = LatencyModel({1: 1.0, 4: 1.3, 7: 3.0})  # rows cost 0.1 s each up to 4 tokens, more after
    req = decoding(scheduler)
    scheduler.set_drafts([req], [Draft([], "spectra", lookahead=CHAINS, lookahead_yield=0.05)])
    assert scheduler.schedule().scheduled[0].lookahead == []  # 3 rows earn 0.15 tokens for 0.3 s on a 1 s step
    step(scheduler, scheduler.schedule(), [[9]])
    scheduler.set_drafts([req], [Draft([], "spectra", lookahead=CHAINS, lookahead_yield=0.5)])
    out = scheduler.schedule()
    assert out.scheduled[0].lookahead == [CHAINS[0]]  # 1.5 tokens for 0.3 s pays; a second chain's 0.75 s does not
    assert out.expected_tokens == 1.0  # what the rows earn comes in later steps


def test_chains_stop_at_the_models_length():
    scheduler = make_scheduler(max_model_len=8)
    req = decoding(scheduler)  # 4 tokens: positions up to 7 leave room for 4 rows
    scheduler.set_drafts([req], [Draft([], "spectra", lookahead=CHAINS)])
    assert scheduler.schedule().scheduled[0].lookahead == [CHAINS[0]]
