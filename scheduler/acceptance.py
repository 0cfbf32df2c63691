"""Acceptance estimates for drafted tokens: running statistics per drafter, draft depth and sibling rank,
blended with the request's own history.

The estimate of a node is the conditional probability that it is accepted given
that its parent was (verification accepts at most one child of a node). Statistics
learn only from nodes whose parent was accepted: a node after a rejection was never
tried. A drafter that knows better gives its own per-token estimate with the draft
(`Draft.acceptance`), which is used as it is; other estimators (a companion model,
say) implement the same `estimate` method.
"""
from __future__ import annotations

from typing import Protocol

from drafters.base import Draft
from drafters.tree import ROOT, depths, sibling_ranks
from scheduler.request import Request

NodeKey = tuple[int, int]  # (depth, sibling rank); depth 1 = a child of the request's last token


class AcceptanceEstimator(Protocol):
    def estimate(self, req: Request, draft: Draft) -> list[float]:
        """[len(draft)] conditional acceptance probability of each drafted node."""

    def observe(self, req: Request, draft: Draft, verified: list[int], accepted: list[int]) -> None:
        """Record that the VERIFIED nodes of DRAFT were verified and the ACCEPTED path of them accepted."""


class Counts:
    """How often nodes of each (depth, rank) were tried (their parent accepted) and accepted."""

    def __init__(self) -> None:
        self.tried: dict[NodeKey, int] = {}
        self.accepted: dict[NodeKey, int] = {}

    def add(self, key: NodeKey, accepted: bool) -> None:
        self.tried[key] = self.tried.get(key, 0) + 1
        self.accepted[key] = self.accepted.get(key, 0) + accepted


class TreeAcceptance:
    def __init__(self, prior: float, prior_weight: float) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.by_drafter: dict[str, Counts] = {}  # drafter -> counts over every request
        self.by_request: dict[str, Counts] = {}  # request id -> its own counts

    def estimate(self, req: Request, draft: Draft) -> list[float]:
        if draft.acceptance is not None:
            return list(draft.acceptance)
        shared = self.by_drafter.get(draft.source, Counts())
        own = self.by_request.get(req.request_id, Counts())
        cache: dict[NodeKey, float] = {}
        return [
            self._shrink(own, key, self._shared_rate(shared, key, cache))
            for key in zip(depths(draft.parents), sibling_ranks(draft.parents))
        ]

    def _shared_rate(self, counts: Counts, key: NodeKey, cache: dict[NodeKey, float]) -> float:
        """Each (depth, rank) shrinks towards the rank's rate one level up, and a first-level rank towards the
        rank before it: nodes never verified inherit what was learnt about their nearest relatives."""
        if key not in cache:
            depth, rank = key
            if depth > 1:
                prior = self._shared_rate(counts, (depth - 1, rank), cache)
            elif rank > 0:
                prior = self._shared_rate(counts, (1, rank - 1), cache)
            else:
                prior = self.prior
            cache[key] = self._shrink(counts, key, prior)
        return cache[key]

    def _shrink(self, counts: Counts, key: NodeKey, prior: float) -> float:
        tried, accepted = counts.tried.get(key, 0), counts.accepted.get(key, 0)
        return (accepted + prior * self.prior_weight) / (tried + self.prior_weight)

    def observe(self, req: Request, draft: Draft, verified: list[int], accepted: list[int]) -> None:
        shared = self.by_drafter.setdefault(draft.source, Counts())
        own = self.by_request.setdefault(req.request_id, Counts())
        for key, was_accepted in tried_nodes(draft, verified, accepted):
            shared.add(key, was_accepted)
            own.add(key, was_accepted)

    def forget(self, request_id: str) -> None:
        self.by_request.pop(request_id, None)


def tried_nodes(draft: Draft, verified: list[int], accepted: list[int]) -> list[tuple[NodeKey, bool]]:
    """The verified nodes whose parent was accepted (or is the root), with their key and whether they were accepted."""
    node_depths, ranks = depths(draft.parents), sibling_ranks(draft.parents)
    on_path = set(accepted)
    return [
        ((node_depths[n], ranks[n]), n in on_path)
        for n in verified if draft.parents[n] == ROOT or draft.parents[n] in on_path
    ]
