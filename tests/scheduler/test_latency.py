"""The latency model's profile, and what real steps cost beyond it by batch size."""
import pytest

from scheduler.latency import ERROR_BOUND, OVERHEAD_SMOOTHING, ROW_PRICE_DECAY, STALE_STEPS, LatencyModel, StepOverhead


def test_the_profile_is_interpolated_and_never_cheaper_for_more_tokens():
    latency = LatencyModel({1: 1.0, 16: 2.5, 32: 2.0})  # profiling noise: 32 tokens measured faster than 16
    assert latency(0) == 1.0 and latency(8.5) == pytest.approx(1.75)
    assert latency(32) == 2.5 and latency(64) == 2.5
    model = LatencyModel({1: 1.0, 3: 3.0, 5: 2.0})  # a noisy profile where 5 looked cheaper than 3
    assert model(2) == pytest.approx(2.0) and model(4) == pytest.approx(3.0)
    assert model(7) >= model(5)
    with pytest.raises(ValueError):
        LatencyModel({})


def test_the_step_overhead_is_learnt_apart_for_each_class_of_batch_size():
    overhead = StepOverhead()
    assert overhead(64) == 0.0  # nothing measured: the profile alone
    for _ in range(200):
        overhead.observe(64, 0.012 - overhead(64))  # a batch of 64 takes 12 ms more than its profile
        overhead.observe(1, 0.001 - overhead(1))  # one request alone 1 ms more
    assert overhead(64) == pytest.approx(0.012) and overhead(127) == pytest.approx(0.012)
    assert overhead(1) == pytest.approx(0.001)


def test_a_batch_size_not_measured_yet_borrows_the_nearest_measured_class_and_learns_from_there():
    overhead = StepOverhead()
    overhead.observe(2, 0.002)  # the class of 2..3, from nothing
    two = OVERHEAD_SMOOTHING * 0.002
    overhead.observe(64, 0.010)  # the class of 64..127 starts from the nearest measured one's, 2..3's
    sixty_four = two + OVERHEAD_SMOOTHING * 0.010
    assert overhead(2) == pytest.approx(two) and overhead(64) == pytest.approx(sixty_four)
    assert overhead(1) == overhead(4) == overhead(2)  # one class from 2..3
    assert overhead(32) == overhead(64)  # one class from 64..127, four from 2..3
    assert overhead(8) == overhead(2)  # two classes from 2..3, three from 64..127
    overhead.observe(16, 0.005)  # two classes from 64..127, three from 2..3
    assert overhead(16) == pytest.approx(sixty_four + OVERHEAD_SMOOTHING * 0.005)
    assert overhead(2) == pytest.approx(two) and overhead(64) == pytest.approx(sixty_four)


def test_a_price_per_row_is_learnt_beside_the_price_per_step():
    """Steps that verify more rows cost the host more (their verification): the two prices come apart from steps
    with different row counts, and the price per row is never below zero."""
    overhead = StepOverhead()
    for i in range(3000):
        rows = i % 5
        overhead.observe(1, 0.004 + 0.0007 * rows - overhead(1, rows), rows)
    per_step, per_row = overhead.prices(1)
    assert per_step == pytest.approx(0.004, rel=0.02) and per_row == pytest.approx(0.0007, rel=0.02)
    assert overhead(1, 3) == pytest.approx(0.004 + 3 * 0.0007, rel=0.02)
    for i in range(3000):  # rows turn cheaper than the profile says: the step price takes it, not a negative row
        rows = i % 5
        overhead.observe(1, 0.004 - 0.0005 * rows - overhead(1, rows), rows)
    assert overhead.prices(1)[1] == 0.0


def test_one_stalled_step_counts_no_more_than_a_few_times_its_prediction():
    """A step that took half a second (descheduled, faulting) moves the prices as a step ERROR_BOUND times its
    prediction late would, not by half a second."""
    stalled, late = StepOverhead(), StepOverhead()
    stalled.observe(1, 0.5, 1, predicted=0.012)
    late.observe(1, ERROR_BOUND * 0.012, 1, predicted=0.012)
    assert stalled.prices(1) == late.prices(1)
    assert stalled.prices(1)[1] == pytest.approx(OVERHEAD_SMOOTHING * ERROR_BOUND * 0.012 / 2)


def test_a_price_per_row_that_stopped_every_row_falls_back_while_rows_are_declined():
    """Only steps with rows measure the price per row; one too high would keep the planner from ever verifying a row,
    so steps that decline the rows offered them shrink it until rows are tried again."""
    overhead = StepOverhead()
    overhead.by_class[1] = (0.0, 0.050)  # 50 ms a row: no draft would ever pay
    for _ in range(STALE_STEPS):  # a while without rows is not yet a reason to doubt the price
        overhead.observe(1, 0.0 - overhead(1), 0, predicted=0.012, offered=True)
    assert overhead.prices(1)[1] == 0.050
    for _ in range(230):
        overhead.observe(1, 0.0 - overhead(1), 0, predicted=0.012, offered=True)
    assert overhead.prices(1)[1] == pytest.approx(0.050 * (1 - ROW_PRICE_DECAY) ** 230)
    assert overhead.prices(1)[1] < 0.005
    overhead.observe(1, 0.0 - overhead(1, 1), 1, predicted=0.012)  # a step with a row measures it again
    assert overhead.declined[1] == 0


def test_steps_offered_no_row_leave_the_price_per_row_as_measured():
    """Requests resting from drafting (scheduler/drafting_gate.py) offer no rows for most steps; those steps say
    nothing of what a row costs, so the price the last rows measured stays, and the planner does not come to verify
    rows at a loss because drafts were rarely offered."""
    overhead = StepOverhead()
    for i in range(3000):
        rows = i % 3
        overhead.observe(1, 0.001 + 0.0009 * rows - overhead(1, rows), rows, predicted=0.008)
    measured = overhead.prices(1)[1]
    assert measured == pytest.approx(0.0009, rel=0.05)
    for _ in range(10 * STALE_STEPS):
        overhead.observe(1, 0.001 - overhead(1), 0, predicted=0.008)
    assert overhead.prices(1)[1] == measured
    for _ in range(STALE_STEPS + 10):  # a few rows offered and declined after the rest: now it is doubted
        overhead.observe(1, 0.001 - overhead(1), 0, predicted=0.008, offered=True)
    assert overhead.prices(1)[1] == pytest.approx(measured * (1 - ROW_PRICE_DECAY) ** 10)
