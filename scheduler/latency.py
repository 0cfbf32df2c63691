"""Latency model of one forward pass: how many tokens it carries, and how many root-to-leaf paths its trees add;
and what real steps cost beyond it, as measured.

A draft tree is attended as the chains of its paths (engine/model/attention_layout.py), each
reading its request's whole cached context again, so a tree costs more than a chain of
as many tokens: each path beyond the first costs about `path_seconds_per_position` per
position of context it reads (profiled at start-up, engine/model/profiler.py).

The profile is one request's forward; a real step of B requests also attends over B
contexts and samples and verifies B rows. What that costs beyond the profile is learnt
from measured steps (`StepOverhead`), apart for each size of batch: it grows with the
batch, so the overhead of a full batch would overprice the steps of its last requests."""
from __future__ import annotations

import bisect

# weight of the latest measurement in the running means of what real forwards cost beyond a profile
OVERHEAD_SMOOTHING = 0.1
# a price per row unmeasured for STALE_STEPS steps that declined rows shrinks by ROW_PRICE_DECAY a step (StepOverhead):
# one ten times too high falls back within ~260 such steps
STALE_STEPS = 32
ROW_PRICE_DECAY = 0.01
ERROR_BOUND = 3.0  # a step's error counts at most this many times its predicted seconds (StepOverhead)


class LatencyModel:
    """Piecewise-linear interpolation of profiled forward times (seconds) over token counts."""

    def __init__(self, seconds_by_num_tokens: dict[int, float], path_seconds_per_position: float = 0.0) -> None:
        self.path_seconds_per_position = path_seconds_per_position
        if not seconds_by_num_tokens:
            raise ValueError("a latency model needs at least one profiled point")
        points = sorted(seconds_by_num_tokens.items())
        self.num_tokens = [n for n, _ in points]  # [num_points] ascending
        self.seconds = self._monotone([s for _, s in points])  # [num_points]

    @staticmethod
    def _monotone(seconds: list[float]) -> list[float]:
        """More tokens never cost less: profiling noise must not reward longer forwards."""
        result, floor = [], 0.0
        for value in seconds:
            floor = max(floor, value)
            result.append(floor)
        return result

    def __call__(self, num_tokens: int) -> float:
        xs, ys = self.num_tokens, self.seconds
        if len(xs) == 1 or num_tokens <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, num_tokens), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)

    def extra_path_seconds(self, context_len: int) -> float:
        """What one more root-to-leaf path of a tree costs a request with CONTEXT_LEN cached positions."""
        return self.path_seconds_per_position * context_len


class StepOverhead:
    """What real steps cost beyond the start-up profile, per class of batch size (1, 2-3, 4-7, ...): a price per
    step and one per row beyond each request's own token (a drafted token verified, a look-ahead row).

    One constant learnt while a batch of 64 runs would price the steps of its last few requests at batch 64's
    overhead, several times their forward, and a draft model then looks cheap beside them. The profile is a forward
    alone; each row verified also costs the host its verification (under sampling, a softmax over the vocabulary
    and a draw), which a price per step would spread over the steps that verify nothing and leave out of what the
    planner weighs a drafted token by. Both prices are learnt together from each step's error, the normalised
    least-mean-squares step over the features (1, rows); the price per row never goes below zero (a profile that
    overprices rows stays the profile's). A class not measured yet borrows the nearest measured class's prices.

    Two guards keep one bad step from ending speculation for good. A step's error counts at most ERROR_BOUND times
    its predicted seconds: a step descheduled or faulting for half a second says little about rows, and its full
    error would raise the price per row so far that the planner verifies no row again. And a price per row is only
    measured by steps that verify rows, so one too high would never be corrected: after STALE_STEPS steps that
    declined every row offered them, each further one shrinks it by ROW_PRICE_DECAY, until rows pay again in the
    planner's eyes and their steps measure it anew (a price that is right then costs an occasional retry while drafts
    do not pay). Steps offered no row say nothing about the price and leave it be: where drafts rarely pay (sampling
    at T = 1 on chat), requests rest from drafting most steps (scheduler/drafting_gate.py), and counting those steps
    shrank the price to a tenth of what a row costs, so that the planner verified rows at a loss."""

    def __init__(self) -> None:
        # batch size class (the bit length of the batch size) -> (seconds per step, seconds per row)
        self.by_class: dict[int, tuple[float, float]] = {}
        self.declined: dict[int, int] = {}  # batch size class -> its steps that declined rows since the last with rows

    def __call__(self, batch_size: int, num_rows: int = 0) -> float:
        per_step, per_row = self.prices(batch_size)
        return per_step + per_row * num_rows

    def prices(self, batch_size: int) -> tuple[float, float]:
        """(seconds per step, seconds per row beyond the batch's own tokens) for BATCH_SIZE."""
        if not self.by_class:
            return 0.0, 0.0
        size_class = batch_size.bit_length()
        nearest = min(self.by_class, key=lambda measured: (abs(measured - size_class), measured))
        return self.by_class[nearest]

    def observe(self, batch_size: int, error: float, num_rows: int = 0, predicted: float | None = None,
                offered: bool = False) -> None:
        """A step of BATCH_SIZE requests with NUM_ROWS rows beyond their own tokens took ERROR seconds longer than
        PREDICTED (None: no bound on the error) with these prices; OFFERED: drafted rows were offered to it."""
        per_step, per_row = self.prices(batch_size)
        if predicted is not None:
            bound = ERROR_BOUND * predicted
            error = min(max(error, -bound), bound)
        step = OVERHEAD_SMOOTHING * error / (1 + num_rows * num_rows)
        size_class = batch_size.bit_length()
        if num_rows:
            per_row += step * num_rows
            self.declined[size_class] = 0
        elif offered:
            self.declined[size_class] = self.declined.get(size_class, 0) + 1
            if self.declined[size_class] > STALE_STEPS:
                per_row *= 1 - ROW_PRICE_DECAY
        self.by_class[size_class] = (per_step + step, max(per_row, 0.0))
