"""Goodput planner: which drafted tokens to verify (Speculative Verification, §5).

Verifying the first k drafted tokens of a request yields, in expectation,
sum_{j<=k} prod_{i<=j} a_i accepted tokens beyond the one token every request gets
(a_i: conditional acceptance of draft position i). Over a batch, the planner starts
from the tokens every request must process (its prefill chunk, or its last token),
then adds drafted tokens one at a time, always the one — from any request, in order
within a request — with the largest expected gain, and keeps the prefix of that order
whose goodput (expected tokens per second of forward latency) is highest. SV stops
at the first decline, assuming goodput is concave; taking the best prefix gives the
same answer then and stays right when a noisy latency profile is not concave.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

from scheduler.latency import LatencyModel


def expected_tokens(acceptance: list[float]) -> list[float]:
    """[len(acceptance) + 1] expected tokens gained by verifying k = 0..len drafted tokens."""
    expected, survive = [1.0], 1.0
    for rate in acceptance:
        survive *= rate
        expected.append(expected[-1] + survive)
    return expected


def plan_verification(
    acceptance: list[list[float]],
    num_base_tokens: int,
    num_base_expected: float,
    latency: Callable[[int], float],
    max_draft_tokens: int | None = None,
) -> list[int]:
    """Per request, how many of its drafted tokens to verify.

    acceptance[r]: [num drafted tokens of request r] conditional acceptance estimates.
    num_base_tokens: tokens in the forward before any draft (prefill chunks + one per decoding request).
    num_base_expected: tokens the batch yields without drafts (one per decoding request).
    latency: seconds of a forward over n tokens.
    max_draft_tokens: drafted tokens the step's token budget leaves room for (None: no bound).
    """
    chosen = [0] * len(acceptance)
    order = _greedy_order(acceptance)[:max_draft_tokens]
    best_len, best_goodput = 0, num_base_expected / latency(num_base_tokens)
    expected = num_base_expected
    for length, (gain, request) in enumerate(order, start=1):
        expected += gain
        goodput = expected / latency(num_base_tokens + length)
        if goodput > best_goodput * (1 + 1e-9):
            best_len, best_goodput = length, goodput
    for _, request in order[:best_len]:
        chosen[request] += 1
    return chosen


def _greedy_order(acceptance: list[list[float]]) -> list[tuple[float, int]]:
    """All drafted tokens as (expected gain, request), largest gain first, in order within a request."""
    heap = [(-rates[0], r, 0, rates[0]) for r, rates in enumerate(acceptance) if rates]
    heapq.heapify(heap)
    order = []
    while heap:
        _, request, position, survive = heapq.heappop(heap)
        order.append((survive, request))
        rates = acceptance[request]
        if position + 1 < len(rates):
            next_survive = survive * rates[position + 1]
            heapq.heappush(heap, (-next_survive, request, position + 1, next_survive))
    return order


def best_num_draft_tokens(acceptance: list[float], latency: LatencyModel, num_base_tokens: int = 1) -> int:
    """The single-request plan: drafted tokens to verify after one real token."""
    return plan_verification([acceptance], num_base_tokens, 1.0, latency)[0]
