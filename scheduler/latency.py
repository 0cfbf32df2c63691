"""Latency model of one forward pass as a function of how many tokens it carries."""
from __future__ import annotations

import bisect


class LatencyModel:
    """Piecewise-linear interpolation of profiled forward times (seconds) over token counts."""

    def __init__(self, seconds_by_num_tokens: dict[int, float]) -> None:
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
