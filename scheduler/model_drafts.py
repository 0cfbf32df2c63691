"""Drafting with a model is scheduled work: how many tokens each decoding request drafts next, with its blocks.

Drafting k tokens costs k forwards of the draft model over the batch before the target
verifies anything, so whether to draft is decided before drafting. Without the goodput
planner every request drafts k tokens (fixed-k speculative decoding). With it, the batch
drafts the depth d in 0..k whose expected goodput is best:

    goodput(d) = B (1 + sum_{i<=d} P_i) / (target(B (1 + d)) + d draft(B) + companion(B d)),

where P_i is the probability that the i-th drafted token is on the accepted path (the
product of the acceptance estimates of depths 1..i, averaged over the batch), target(n),
draft(n) and companion(n) the profiled latencies of a forward over n tokens (the
companion, when there is one, scores every drafted token in one forward). B counts only the
requests about to draft with the model (under `copyspec+draft`, those CopySpec left without a
draft), since only they gain from it.

d = 0 turns the draft model off; it then drafts one token anyway (a probe) once the steps
it stayed off have cost 1/share times that one-token draft, so that its acceptance keeps
being measured and drafting comes back when it pays again. The share starts at
EXPLORE_SHARE (a probe every ~50th step for a draft model as slow as the target, every few
steps for a cheap one) and halves after every probe that left the draft off, down to
MIN_EXPLORE_SHARE (every ~500th step): a draft model that never pays costs ~0.2 % of the
time once it has been found out, and one that pays again is back within ~500 steps at most.
The planner then chooses, as for any draft, which drafted tokens are verified.

Positions drafted with the model need KV slots (the draft model writes its KV there):
the request's blocks are grown to cover them, as far as free blocks allow; the next
step's update gives back what was not accepted.
"""
from __future__ import annotations

from collections.abc import Callable

from drafters.base import Draft
from scheduler.acceptance import AcceptanceEstimator
from scheduler.draft_selection import draft_depth_limit
from scheduler.kv_blocks import KVBlockManager
from scheduler.planner import PlannedTree, path_probabilities
from scheduler.request import Request

EXPLORE_SHARE = 0.02  # of the step time, spent on one-token drafts right after the planner turned drafting off
MIN_EXPLORE_SHARE = 0.002  # ... and after it kept it off through many probes


def best_draft_depth(
    path_probs: list[float], batch: int, target_seconds: Callable[[int], float], draft_seconds: Callable[[int], float],
    companion_seconds: Callable[[int], float] = lambda num_tokens: 0.0,
) -> int:
    """The depth d in 0..len(path_probs) with the best expected goodput for a batch of BATCH decoding requests."""
    best_depth, best = 0, batch / target_seconds(batch)
    expected = float(batch)
    for depth, probability in enumerate(path_probs, start=1):
        expected += batch * probability
        seconds = target_seconds(batch * (1 + depth)) + depth * draft_seconds(batch) + companion_seconds(batch * depth)
        goodput = expected / seconds
        if goodput > best * (1 + 1e-9):
            best_depth, best = depth, goodput
    return best_depth


class ModelDraftBudget:
    def __init__(
        self, estimator: AcceptanceEstimator, blocks: KVBlockManager, max_model_len: int,
        target_seconds: Callable[[int], float] | None, draft_seconds: Callable[[int], float] | None,
        companion_seconds: Callable[[int], float] | None = None,
    ) -> None:
        self.estimator = estimator
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.target_seconds = target_seconds  # None: no planner, every request drafts the most it may
        self.draft_seconds = draft_seconds
        self.companion_seconds = companion_seconds or (lambda num_tokens: 0.0)
        self.steps_off = 0  # steps the planner kept drafting off since the last probe
        self.probes_off = 0  # probes since the planner last chose to draft

    def reserve(self, reqs: list[Request], max_tokens: int, source: str) -> dict[str, int]:
        """Per request id, how many tokens it drafts with SOURCE's model next; their KV blocks are reserved."""
        depth = self._depth(reqs, max_tokens, source)
        return {req.request_id: self._reserve(req, min(depth, draft_depth_limit(req, self.max_model_len))) for req in reqs}

    def _depth(self, reqs: list[Request], max_tokens: int, source: str) -> int:
        if self.target_seconds is None or self.draft_seconds is None or not reqs:
            return max_tokens
        probe = Draft([0] * max_tokens, source)
        by_request = [path_probabilities(PlannedTree(probe.parents, self.estimator.estimate(req, probe))) for req in reqs]
        mean = [sum(column) / len(reqs) for column in zip(*by_request)]
        depth = best_draft_depth(mean, len(reqs), self.target_seconds, self.draft_seconds, self.companion_seconds)
        if depth:
            self.steps_off = self.probes_off = 0
            return depth
        self.steps_off += 1
        if self.steps_off * self.explore_share * self.target_seconds(len(reqs)) < self.draft_seconds(len(reqs)):
            return 0
        self.steps_off = 0
        self.probes_off += 1
        return 1

    @property
    def explore_share(self) -> float:
        """The share of the step time probes may take now: halved by every probe since drafting was last on."""
        return max(EXPLORE_SHARE / 2 ** self.probes_off, MIN_EXPLORE_SHARE)

    def _reserve(self, req: Request, num_tokens: int) -> int:
        """Grow the request's blocks to cover NUM_TOKENS drafted positions after its computed ones, or as many as
        the free blocks allow; returns how many it may draft."""
        start = req.num_computed_tokens  # the round's first forward computes the last token there
        num_tokens = max(min(num_tokens, self.blocks.positions_available(req.request_id) - start), 0)
        if num_tokens:
            self.blocks.grow(req.request_id, start + num_tokens)
        return num_tokens
