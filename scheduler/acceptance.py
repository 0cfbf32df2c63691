"""Acceptance estimates for drafted tokens: running statistics per drafter and draft position,
blended with the request's own history.

The estimate at position i is the conditional probability that the i-th drafted
token is accepted given that the ones before it were. Other estimators (a
companion model, say) implement the same `estimate` method.
"""
from __future__ import annotations

from typing import Protocol

from scheduler.request import Request


class AcceptanceEstimator(Protocol):
    def estimate(self, req: Request, num_positions: int) -> list[float]:
        """[num_positions] conditional acceptance probability of each drafted position."""

    def observe(self, req: Request, num_verified: int, num_accepted: int) -> None:
        """Record that `num_verified` drafted tokens were verified and the first `num_accepted` accepted."""


class PositionalAcceptance:
    def __init__(self, prior: float, prior_weight: float) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.num_offered: dict[str, list[int]] = {}  # drafter -> [position] times verified
        self.num_accepted: dict[str, list[int]] = {}  # drafter -> [position] times accepted

    def estimate(self, req: Request, num_positions: int) -> list[float]:
        """Each position shrinks towards the estimate of the position before it, so positions
        that were never verified inherit what was learnt about the last verified ones."""
        offered = self.num_offered.get(req.draft_source, [])
        accepted = self.num_accepted.get(req.draft_source, [])
        global_rate, rates = self.prior, []
        for i in range(num_positions):
            global_rate = self._shrink(_at(accepted, i), _at(offered, i), global_rate)
            own_rate = self._shrink(_at(req.num_accepted_by_position, i), _at(req.num_offered_by_position, i), global_rate)
            rates.append(own_rate)
        return rates

    def _shrink(self, num_accepted: int, num_offered: int, prior: float) -> float:
        return (num_accepted + prior * self.prior_weight) / (num_offered + self.prior_weight)

    def observe(self, req: Request, num_verified: int, num_accepted: int) -> None:
        offered = self.num_offered.setdefault(req.draft_source, [])
        accepted = self.num_accepted.setdefault(req.draft_source, [])
        for counts in (offered, req.num_offered_by_position):
            _add_prefix(counts, min(num_verified, num_accepted + 1))
        for counts in (accepted, req.num_accepted_by_position):
            _add_prefix(counts, num_accepted)


def _at(counts: list[int], i: int) -> int:
    return counts[i] if i < len(counts) else 0


def _add_prefix(counts: list[int], length: int) -> None:
    """Add one to counts[0:length], growing the list as needed."""
    if len(counts) < length:
        counts.extend([0] * (length - len(counts)))
    for i in range(length):
        counts[i] += 1
