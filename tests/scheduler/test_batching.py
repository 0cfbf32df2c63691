"""Continuous batching decisions: token budget, chunked prefill, KV blocks, preemption and fairness."""
import random

from drafters.base import Draft
from scheduler.latency import LatencyModel
from scheduler.records import Verification
from tests.scheduler.test_scheduler import add, make_scheduler, step


def ids(out):
    return [item.req.request_id for item in out.scheduled]


def test_long_prompt_is_prefilled_in_chunks_beside_a_decoding_request():
    scheduler = make_scheduler(budget=8)
    a = add(scheduler, "a", prompt=(5, 6, 7), max_tokens=20, ignore_eos=True)
    step(scheduler, scheduler.schedule(), [[8]])
    b = add(scheduler, "b", prompt=tuple(range(3, 23)), max_tokens=5)  # 20 tokens
    out = scheduler.schedule()
    assert ids(out) == ["a", "b"] and out.num_scheduled_tokens == 8
    assert out.scheduled[1].token_ids == list(range(3, 10)) and out.scheduled[1].num_logits == 0
    outputs, stats = step(scheduler, out, [[9], []])
    assert [o.request_id for o in outputs] == ["a"] and b.num_computed_tokens == 7 and stats.num_scheduled_tokens == 8
    step(scheduler, scheduler.schedule(), [[10], []])
    out = scheduler.schedule()
    last_chunk = out.scheduled[1]
    assert last_chunk.token_ids == list(range(17, 23)) and last_chunk.num_logits == 1
    outputs, _ = step(scheduler, out, [[11], [30]])
    assert b.all_token_ids[-1] == 30 and b.num_computed_tokens == 20 and a.num_output_tokens == 4


def test_drafts_are_cut_to_the_token_budget():
    scheduler = make_scheduler(budget=4)
    req = add(scheduler, max_tokens=50)
    step(scheduler, scheduler.schedule(), [[8]])
    scheduler.set_drafts([req], [Draft(list(range(20, 30)), "copyspec")])
    out = scheduler.schedule()
    assert out.scheduled[0].num_draft_tokens == 3 and out.num_scheduled_tokens == 4


def test_full_pool_preempts_the_youngest_which_later_resumes_from_its_tokens():
    scheduler = make_scheduler(num_blocks=4)  # 16 positions, blocks of 4
    a = add(scheduler, "a", prompt=(5, 6, 7, 3, 4, 9), max_tokens=8, ignore_eos=True)
    b = add(scheduler, "b", prompt=(5, 6, 7, 3, 4, 10), max_tokens=8, ignore_eos=True)
    step(scheduler, scheduler.schedule(), [[11], [12]])
    step(scheduler, scheduler.schedule(), [[13], [14]])
    step(scheduler, scheduler.schedule(), [[15], [16]])  # each holds 8 positions: the pool is full
    out = scheduler.schedule()  # a needs a third block: b gives its blocks back
    assert ids(out) == ["a"] and len(out.preempted) == 1
    assert b.num_computed_tokens == 0 and list(scheduler.waiting) == [b] and "b" not in scheduler.blocks.block_tables
    assert b.all_token_ids == [5, 6, 7, 3, 4, 10, 12, 14, 16]  # its tokens stay; its KV is recomputed
    late = add(scheduler, "late", prompt=(5, 6), max_tokens=2)
    while True:
        step(scheduler, out, [[15]])
        if a.is_finished:
            break
        out = scheduler.schedule()
        assert ids(out) == ["a"]  # first come, first served: "late" would fit, but b is ahead of it
    assert list(scheduler.waiting) == [b, late]
    out = scheduler.schedule()
    assert ids(out) == ["b", "late"] and out.scheduled[0].token_ids == b.all_token_ids


def random_draft(rng) -> Draft:
    """A chain or a tree of up to 8 tokens, each node's parent drawn from the nodes before it."""
    n = rng.randrange(1, 9)
    parents = [i - 1 for i in range(n)] if rng.random() < 0.5 else [rng.randrange(-1, i) for i in range(n)]
    return Draft([rng.randrange(3, 40) for _ in range(n)], "copyspec", parents)


def random_verification(rng, item) -> Verification:
    """A random walk down the verified subtree: some path accepted, then one more token."""
    node, path = -1, []
    while True:
        kids = [j for j, parent in enumerate(item.draft_parents) if parent == node]
        if not kids or rng.random() < 0.3:
            break
        node = rng.choice(kids)
        path.append(node)
    drafts = item.draft_token_ids
    return Verification([drafts[j] for j in path] + [rng.randrange(3, 40)], path)


def simulate(seed, num_requests=30, num_blocks=24, budget=24, max_num_seqs=6):
    """Random prompts, drafts, acceptances and aborts on a tight pool; checks the invariants every step."""
    rng = random.Random(seed)
    scheduler = make_scheduler(
        planner=rng.random() < 0.5, max_waiting=100, max_model_len=64, num_blocks=num_blocks, budget=budget,
        max_num_seqs=max_num_seqs,
    )
    requests, admitted_order, steps = [], [], 0
    for i in range(num_requests):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randrange(1, 30))]
        requests.append(add(scheduler, f"r{i:02d}", prompt=prompt, max_tokens=rng.randrange(1, 20), ignore_eos=True))
    while scheduler.has_work:
        steps += 1
        assert steps < 5000, "the scheduler stopped making progress"
        decoding_before = [r for r in scheduler.running if r.num_uncomputed_tokens == 1]
        out = scheduler.schedule()
        for req in scheduler.running:
            if req.request_id not in admitted_order:
                admitted_order.append(req.request_id)
        assert out.num_scheduled_tokens <= budget
        for item in out.scheduled:  # every scheduled position has a block
            end = item.req.num_computed_tokens + len(item.token_ids)
            assert len(scheduler.blocks.block_tables[item.req.request_id]) * scheduler.blocks.block_size >= end
        for req in decoding_before:  # every decoding request advances or is preempted
            assert req in [item.req for item in out.scheduled] or req in scheduler.waiting
        scheduler.update(
            out, [random_verification(rng, item) if item.num_logits else Verification([]) for item in out.scheduled]
        )
        for req in scheduler.running:
            if req.num_uncomputed_tokens == 1 and rng.random() < 0.7:
                scheduler.set_drafts([req], [random_draft(rng)])
        if rng.random() < 0.05 and scheduler.running:
            scheduler.abort(rng.choice(scheduler.running).request_id)
    return scheduler, requests, admitted_order


def test_random_traffic_on_a_tight_pool_finishes_everything_and_returns_every_block():
    for seed in range(20):
        scheduler, requests, admitted_order = simulate(seed)
        assert all(req.is_finished for req in requests)
        assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks and not scheduler.blocks.block_tables
        assert admitted_order == sorted(admitted_order), "first come, first served: no waiting request is passed over"
        for req in requests:
            if req.finish_reason == "length":
                assert req.num_output_tokens == req.sampling.max_tokens or len(req.all_token_ids) >= 64


def test_measured_step_overhead_makes_drafts_cheaper_to_verify():
    scheduler = make_scheduler(planner=True)
    # a draft costs 0.6 s on a 1 s step: not worth 0.5 tokens
    scheduler.latency = LatencyModel({1: 1.0, 2: 1.6, 4: 2.8})
    req = add(scheduler, max_tokens=100)
    step(scheduler, scheduler.schedule(), [[8]])
    scheduler.set_drafts([req], [Draft([9, 10, 11], "copyspec")])
    out = scheduler.schedule()
    assert out.scheduled[0].num_draft_tokens == 0 and out.predicted_seconds == 1.0
    for _ in range(60):  # real steps take 5 s more than the profile says (say, attention over long contexts)
        scheduler.observe_step_seconds(out, 6.0)
    assert abs(scheduler.step_overhead(1) - 5.0) < 0.01
    out = scheduler.schedule()  # now one forward costs 6 s and a draft 0.6 s more: worth 0.5 tokens
    assert out.scheduled[0].num_draft_tokens > 0 and out.predicted_seconds > 6.0


def test_a_measured_price_per_verified_row_makes_drafts_dearer():
    """The profile says a drafted token costs 0.2 s on a 1 s step; real steps show each verified row costs 0.5 s more
    (its verification on the host). A draft whose first token is right half the time was worth verifying at the
    profile's price and is not at the measured one. Every third step drafts nothing, as real steps sometimes do:
    steps with different row counts tell the price per row from the price per step."""
    scheduler = make_scheduler(planner=True, max_model_len=1024, num_blocks=256)
    scheduler.latency = LatencyModel({1: 1.0, 2: 1.2, 4: 1.6})
    req = add(scheduler, max_tokens=1000, ignore_eos=True)
    step(scheduler, scheduler.schedule(), [[8]])
    verified = []
    for i in range(80):
        scheduler.set_drafts([req], [Draft([9, 10, 11] if i % 3 else [], "copyspec")])
        out = scheduler.schedule()
        verified.append(out.scheduled[0].num_draft_tokens)
        scheduler.observe_step_seconds(out, scheduler.latency(out.num_scheduled_tokens) + 0.5 * verified[-1])
        right = i % 2 == 0  # the target's next token is the drafted 9 every other step
        step(scheduler, out, [([9, 1] if verified[-1] else [9]) if right else [1]])
    assert verified[1] == 1, "at the profile's price one drafted token right half the time pays"
    assert scheduler.step_overhead.prices(1)[1] > 0.3
    assert verified[-10:] == [0] * 10
