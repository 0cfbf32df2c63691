from drafters.base import Draft
from scheduler.drafting_gate import DECLINES_TO_REST, FIRST_REST, MAX_REST, DraftingGate
from scheduler.latency import LatencyModel
from tests.scheduler.test_scheduler import add, make_scheduler, step


def steps_until_proposing(gate: DraftingGate, request_id: str = "r") -> int:
    """Steps the request rests before it proposes again."""
    rested = 0
    while not gate.proposes(request_id):
        rested += 1
    return rested


def test_a_request_rests_after_declined_drafts_and_each_declined_probe_doubles_the_rest():
    gate = DraftingGate()
    for _ in range(DECLINES_TO_REST - 1):
        gate.record("r", num_drafted=3, num_verified=0)
        assert gate.proposes("r")
    rests = []
    for _ in range(6):
        gate.record("r", num_drafted=3, num_verified=0)  # the draft (then each probe) declined
        rests.append(steps_until_proposing(gate))
    assert rests == [FIRST_REST, 2 * FIRST_REST, 4 * FIRST_REST, 8 * FIRST_REST, MAX_REST, MAX_REST]


def test_a_verified_draft_ends_the_rest_and_empty_drafts_count_for_nothing():
    gate = DraftingGate()
    for _ in range(DECLINES_TO_REST + 2):
        gate.record("r", num_drafted=3, num_verified=0)
        steps_until_proposing(gate)
    gate.record("r", num_drafted=3, num_verified=1)
    for _ in range(DECLINES_TO_REST - 1):
        gate.record("r", num_drafted=0, num_verified=0)  # nothing drafted: nothing declined
        gate.record("r", num_drafted=3, num_verified=0)
    assert gate.proposes("r") and gate.num_resting == 0
    gate.record("r", num_drafted=3, num_verified=0)
    assert gate.num_resting == 1 and steps_until_proposing(gate) == FIRST_REST, "the rest starts afresh"
    assert gate.proposes("other"), "requests rest apart"


def test_a_draft_offered_while_resting_neither_ends_nor_lengthens_the_rest():
    gate = DraftingGate()
    for _ in range(DECLINES_TO_REST):
        assert gate.proposes("r") and not gate.resting("r")
        gate.record("r", num_drafted=3, num_verified=0)
    assert not gate.proposes("r") and gate.resting("r")
    gate.record("r", num_drafted=2, num_verified=2)  # what it offered resting was verified
    assert not gate.proposes("r") and gate.resting("r"), "the rest goes on"
    gate.record("r", num_drafted=2, num_verified=0)  # and declined
    assert gate.proposes("r") and not gate.resting("r"), "and ends when it would have: FIRST_REST steps"
    gate.record("r", num_drafted=3, num_verified=0)  # the probe declined: the next rest is twice as long
    assert steps_until_proposing(gate) == 2 * FIRST_REST


def decline_drafts(scheduler, req, count: int) -> None:
    """COUNT steps whose drafts the planner declines (drafts cost more than they yield), each proposed only when the
    scheduler lets the request draft."""
    for _ in range(count):
        drafting = scheduler.drafting([req])
        scheduler.set_drafts(drafting, [Draft([1, 1, 1], "copyspec")] * len(drafting))
        out = scheduler.schedule()
        assert out.scheduled[0].num_draft_tokens == 0
        step(scheduler, out, [[3]])


def test_the_scheduler_clears_the_draft_of_a_resting_request_and_lets_it_probe_later():
    scheduler = make_scheduler(planner=True, max_model_len=1024, num_blocks=256)
    scheduler.latency = LatencyModel({1: 1.0, 2: 1.9, 4: 3.7})  # a draft is worth verifying above 90% acceptance
    req = add(scheduler, max_tokens=1000)
    step(scheduler, scheduler.schedule(), [[8]])
    decline_drafts(scheduler, req, DECLINES_TO_REST)
    req.draft = Draft([1], "copyspec")  # left from before: a resting request must not carry it
    assert scheduler.drafting([req]) == [] and req.draft is None and scheduler.resting([req]) == [req]
    assert scheduler.drafting([req]) == [], "the first rest lasts FIRST_REST steps"
    assert scheduler.drafting([req]) == [req] and scheduler.resting([req]) == [], "then it probes"


def test_nothing_rests_without_the_planner_or_beside_a_draft_model():
    for scheduler in (make_scheduler(planner=False),
                      make_scheduler(planner=True, draft_latency=LatencyModel({1: 0.5}))):
        req = add(scheduler, max_tokens=100)
        step(scheduler, scheduler.schedule(), [[8]])
        for _ in range(3 * DECLINES_TO_REST):
            assert scheduler.drafting([req]) == [req]
            scheduler.set_drafts([req], [Draft([1, 1, 1], "copyspec")])
            out = scheduler.schedule()
            step(scheduler, out, [[3]])
