"""Goodput planner: how many drafted tokens to verify.

Verifying k drafted tokens costs one forward over k+1 tokens and yields
1 + sum_{j<=k} prod_{i<=j} a_i tokens in expectation (a_i: conditional acceptance
of position i). The planner picks the k that maximises expected tokens per second.
This is the single-request form; the batched planner extends it over a batch.
"""
from __future__ import annotations

from scheduler.latency import LatencyModel


def expected_tokens(acceptance: list[float]) -> list[float]:
    """[len(acceptance) + 1] expected tokens gained by verifying k = 0..len drafted tokens."""
    expected, survive = [1.0], 1.0
    for rate in acceptance:
        survive *= rate
        expected.append(expected[-1] + survive)
    return expected


def best_num_draft_tokens(acceptance: list[float], latency: LatencyModel, num_base_tokens: int = 1) -> int:
    """The k that maximises expected tokens / latency(num_base_tokens + k); ties go to fewer tokens."""
    best_k, best_rate = 0, 0.0
    for k, tokens in enumerate(expected_tokens(acceptance)):
        rate = tokens / latency(num_base_tokens + k)
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k
