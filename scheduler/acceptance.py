"""Acceptance estimates for drafted tokens: running statistics per drafter, draft depth and sibling rank, blended
with the request's own history of that drafter's drafts (a request that drafts from two sources, copying and a model
under `copyspec+draft`, keeps them apart: a model's rejected drafts say nothing of its copies).

The estimate of a node is the conditional probability that it is accepted given that its parent was (verification
accepts at most one child of a node). Statistics learn from the whole draft, verified or not: the tokens a step
produces (the accepted path, then the target's own next token) are the target's tokens at depths 1, 2, ..., so every
drafted node whose parent lies on that path is scored against the target's token at its depth. For greedy decoding
the score is the acceptance itself; for point-mass drafts under sampling it is an unbiased draw of it (the target's
token at a depth is its own sample, drafted or not; engine/verifier.py). So a drafter whose drafts go unverified keeps
being measured, and no step has to verify a draft just to learn. A drafter that knows better gives its own per-token
estimate with the draft (`Draft.acceptance`), used as it is; other estimators (a companion model, say) implement the
same `estimate` method.
"""
from __future__ import annotations

from typing import Protocol

from drafters.base import Draft
from drafters.tree import ROOT, depths, scored_walk, sibling_ranks
from scheduler.request import Request

NodeKey = tuple[int, int]  # (depth, sibling rank); depth 1 = a child of the request's last token
# CalibratedEstimator: a verified token's weight in the running sums falls by this with each later one of its key
# (half of it is gone after ~350), and the starting factor 1 is worth this many estimated tokens
CALIBRATION_MEMORY = 1 - 1 / 512
CALIBRATION_PRIOR_TOKENS = 8.0


class AcceptanceEstimator(Protocol):
    def estimate(self, req: Request, draft: Draft) -> list[float]:
        """[len(draft)] conditional acceptance probability of each drafted node."""

    def observe(self, req: Request, draft: Draft, target_token_ids: list[int]) -> None:
        """Score DRAFT against the target's tokens at depths 1, 2, ... (what the step produced for the request)."""

    def factor(self, source: str, sampled: bool) -> float:
        """What SOURCE's estimates are multiplied by (1: they are used as they are)."""


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
        self.by_request: dict[str, dict[str, Counts]] = {}  # request id -> drafter -> its own counts

    def estimate(self, req: Request, draft: Draft) -> list[float]:
        if draft.acceptance is not None:
            return list(draft.acceptance)
        shared = self.by_drafter.get(draft.source, Counts())
        own = self.by_request.get(req.request_id, {}).get(draft.source, Counts())
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

    def observe(self, req: Request, draft: Draft, target_token_ids: list[int]) -> None:
        shared = self.by_drafter.setdefault(draft.source, Counts())
        own = self.by_request.setdefault(req.request_id, {}).setdefault(draft.source, Counts())
        for key, was_accepted in scored_nodes(draft, target_token_ids):
            shared.add(key, was_accepted)
            own.add(key, was_accepted)

    def factor(self, source: str, sampled: bool) -> float:
        return 1.0

    def forget(self, request_id: str) -> None:
        self.by_request.pop(request_id, None)


def scored_nodes(draft: Draft, target_token_ids: list[int]) -> list[tuple[NodeKey, bool]]:
    """Every node whose parent lies on the target's path (drafters/tree.py's scored_walk), with its key (depth,
    sibling rank) and whether its token is the target's at its depth."""
    ranks = sibling_ranks(draft.parents)
    return [((depth, ranks[node]), hit) for node, depth, hit in scored_walk(draft.token_ids, draft.parents,
                                                                            target_token_ids)]


class CalibratedEstimator:
    """An estimator's estimates, corrected by how those of the drafted tokens the planner verified fared: a factor per
    drafter and decoding (greedy or sampled).

    The planner verifies the nodes whose estimates are highest, and the highest of many noisy estimates are too high
    (the winner's curse): the estimates of all drafted tokens can be right while those of the few chosen are not. At
    T = 1 on MT-Bench, SPECTRA's rates over all its drafted tokens matched what they accepted (0.04-0.15), but the
    tokens the planner verified were estimated at 0.36 and accepted 0.22, so it verified rows that cost more than they
    earned; greedy, the verified ones were estimated at 0.47 and accepted 0.51. Each verified token whose parent was
    accepted (so it was tried) adds its estimate and whether it was accepted to running sums that forget at
    CALIBRATION_MEMORY per token; the factor is their ratio, starting from 1 with CALIBRATION_PRIOR_TOKENS estimated
    tokens' weight. Every estimate is multiplied by it (never above 0.99 unless it was already)."""

    def __init__(self, estimator: AcceptanceEstimator) -> None:
        self.estimator = estimator
        self._sums: dict[tuple[str, bool], tuple[float, float]] = {}  # (drafter, sampled) -> (estimated, accepted)

    def estimate(self, req: Request, draft: Draft) -> list[float]:
        factor = self.factor(draft.source, req.sampled)
        return [min(factor * rate, max(rate, 0.99)) for rate in self.estimator.estimate(req, draft)]

    def observe(self, req: Request, draft: Draft, target_token_ids: list[int]) -> None:
        self.estimator.observe(req, draft, target_token_ids)

    def forget(self, request_id: str) -> None:
        self.estimator.forget(request_id)

    def observe_verified(self, req: Request, draft: Draft, nodes: list[int], parents: list[int],
                         accepted: list[int]) -> None:
        """The planner verified NODES of DRAFT (PARENTS: within them) and ACCEPTED those (indices into NODES); called
        before `observe` scores the draft, while the estimates are those the planner chose by."""
        rates = self.estimator.estimate(req, draft)
        key = (draft.source, req.sampled)
        estimated, accepted_sum = self._sums.get(key, (0.0, 0.0))
        for node, hit in tried_nodes(parents, accepted):
            estimated = estimated * CALIBRATION_MEMORY + rates[nodes[node]]
            accepted_sum = accepted_sum * CALIBRATION_MEMORY + hit
        self._sums[key] = (estimated, accepted_sum)

    def factor(self, source: str, sampled: bool) -> float:
        estimated, accepted = self._sums.get((source, sampled), (0.0, 0.0))
        return (accepted + CALIBRATION_PRIOR_TOKENS) / (estimated + CALIBRATION_PRIOR_TOKENS)

    def factors(self) -> dict[str, dict[str, float]]:
        """Drafter -> "greedy" or "sampled" -> its factor, for every drafter and decoding observed."""
        factors: dict[str, dict[str, float]] = {}
        for source, sampled in self._sums:
            factors.setdefault(source, {})["sampled" if sampled else "greedy"] = self.factor(source, sampled)
        return factors


def tried_nodes(parents: list[int], accepted: list[int]) -> list[tuple[int, bool]]:
    """Of a verified selection (PARENTS within it, ROOT the last token), each node whose parent was ACCEPTED (or is
    the last token), with whether it was accepted itself."""
    on_path = set(accepted)
    return [(node, node in on_path) for node, parent in enumerate(parents) if parent == ROOT or parent in on_path]
