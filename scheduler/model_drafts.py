"""Drafting with a model is scheduled work: how many tokens each decoding request drafts next, with its blocks.

Drafting k tokens costs k draft-model forwards before the target verifies anything, so whether to draft is decided
first. Without the goodput planner every request drafts k (fixed-k); with it the batch drafts the depth d in 0..k
with the best expected goodput over the whole next step, since the draft's forwards delay every request of the step:
    goodput(d) = (E + B (1 + sum_{i<=d} P_i)) / (target(N + B (1 + d)) + d draft(B) + companion(B d))
(a companion head scores in lockstep with the draft head: d companion(B) in place of companion(B d));
B: the requests about to draft with the model; P_i: the probability that the i-th drafted token is on the accepted
path, averaged over them; target/draft/companion(n): a forward's latency over n tokens, the start-up profile plus
the overhead real steps show (the target's StepOverhead, the draft's running mean per chain of a forward, learnt
from steady rounds: a round whose first forward reads a prompt or what a stretch off left unread computes one row of
logits a chain where the profile prices one a token, and teaches nothing); N, E: the tokens the rest of the batch is
expected to verify and yield. The decision prices a round in its steady state, one token per request in each
forward: what a stretch off leaves unread is read once whenever drafting resumes, and pricing it into every decision
would keep drafting off for good (the unread tokens only grow); instead a request the model has fallen behind on
drafts in a chosen round only where reading what it missed costs less than the round saves a request, times the
tokens it may still generate (at B = 64, a round chosen near the end of its answers read 8,000 tokens in 0.9 s).
Where not even a draft the target always accepts would pay, drafting stays off unprobed. Otherwise d = 0 turns it off
and a one-token probe runs once the steps off have cost 1/share times the probe (priced at what the last probe took,
where that is more than a steady round: a probe first reads what the model missed while off, hundreds of tokens at a
batch of 16), the share halving from EXPLORE_SHARE to MIN_EXPLORE_SHARE after each probe that leaves it off, so its
acceptance keeps being measured; an off decision holds for the same batch until a probe or KEEP_OFF_STEPS. A probe
drafts for a sample of the batch (PROBE_REQUESTS, those the model has read the most of, so mostly the same requests
from one probe to the next while they last), since its cost is mostly the model reading what it missed of each
request it drafts for.

A model that estimates its own tokens' acceptance as it drafts them (an EAGLE head: its probability of each token) is
planned by those estimates for greedy batches, since the verification planner then verifies only the drafted tokens
whose estimates pay for their rows: the batch drafts when its drafts are expected to gain more than the forwards
that draft them (each node max(0, f P - r) tokens, P its path's estimate, f the planner's calibration, r a verified
row's cost in tokens, over the model's last drafts), and each greedy request may then draft up to k levels, its chain
or tree's ends going on while the likeliest together are expected to gain what the next forward costs (`continuing`;
a head's tree offers several ends of a request, drafters/head_draft.py). Measured chain
rates undervalue such a model: on MT-Bench at B = 1 the shipped head's first tokens are accepted 34 % of the time,
which pays for neither its forward and row, while the ones it gives 0.5 or more are accepted 51-93 %. Drafted
positions need KV slots (the draft model writes its KV there): the request's blocks grow to cover them as far as free
blocks allow, and the next step's update gives back what is not accepted.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from drafters.base import Draft
from drafters.tree import depths
from scheduler.acceptance import AcceptanceEstimator
from scheduler.draft_selection import draft_depth_limit
from scheduler.kv_blocks import KVBlockManager
from scheduler.latency import OVERHEAD_SMOOTHING
from scheduler.planner import PlannedTree, expected_accepted, path_probabilities, plan_verification
from scheduler.request import Request

# an off decision (NEVER: no acceptance could pay; OFF: the estimated one does not) holds for the same batch this many
# steps or until a probe: the estimates it rests on change only when a draft is verified, and deciding costs a pass
# over every depth's latency and estimate each step (~0.2 ms of a 12-14 ms step on a 2-core CPU)
KEEP_OFF_STEPS = 16
# EXPLORE: a model that knows its acceptance drafts, to gather the drafts that decide whether it pays
DRAFT, EXPLORE, NEVER, OFF = "draft", "explore", "never", "off"
DRAFTS_KEPT = 64  # a model's last drafts with its own estimates, which decide whether it drafts next
# ... and how many it drafts before they decide (a handful says little: the first tokens of answers are the head's least
# sure), at start and after each probe, which forgets the drafts kept (they are as old as the off decision), so that the
# decision rests on fresh ones; the probe is priced at what those rounds were expected to lose (little where drafting
# nearly paid: it is then probed often), or at what the last probe took where that is more
DRAFTS_TRUSTED = 16
# a probe, and a round drafting to gather the model's own estimates, draft for at most this many requests of the batch,
# those the model has read the most of: a request's first round after a stretch off reads all the model missed of it
# (its prompt, at its first). At B = 64 a probe of every request read 6,600 tokens in 0.6 s, four steps; at B = 16
# (waves of new questions, 12 rounds) probes of 4 instead of 16 read 4,500 tokens instead of 11,500 and cut the
# resting head's host time a step from 1.13 to 0.88 ms (`none`: 0.18)
PROBE_REQUESTS = 4
EXPLORE_SHARE = 0.02  # of the step time, spent on one-token drafts right after the planner turned drafting off
MIN_EXPLORE_SHARE = 0.002  # ... and after it kept it off through many probes


class OffDecision(NamedTuple):
    """The planner's decision to keep drafting off (NEVER or OFF) for a batch, with what its probes are priced by."""

    decision: str
    step_seconds: float  # the batch's predicted step without drafting
    probe_seconds: float  # what a probe is budgeted at (`_probe_price`)
    selective: bool  # the model knows its tokens' acceptance and the batch is greedy


def best_draft_depth(
    path_probs: list[float], batch: int, step_seconds: Callable[[int], float], rest_expected: float = 0.0,
) -> int:
    """The depth d in 0..len(path_probs) with the best expected goodput of a step in which BATCH decoding requests draft
    d tokens each: STEP_SECONDS(d) is that step's time, drafting included; REST_EXPECTED the tokens the rest of the
    batch is expected to yield."""
    expected = rest_expected + batch
    best_depth, best = 0, expected / step_seconds(0)
    for depth, probability in enumerate(path_probs, start=1):
        expected += batch * probability
        goodput = expected / step_seconds(depth)
        if goodput > best * (1 + 1e-9):
            best_depth, best = depth, goodput
    return best_depth


class ModelDraftBudget:
    def __init__(
        self, estimator: AcceptanceEstimator, blocks: KVBlockManager, max_model_len: int,
        target_seconds: Callable[[int], float] | None, draft_seconds: Callable[[int], float] | None,
        companion_seconds: Callable[[int], float] | None = None, companion_in_lockstep: bool = False,
    ) -> None:
        self.estimator = estimator
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.target_seconds = target_seconds  # None: no planner, every request drafts the most it may
        self.draft_seconds = draft_seconds  # the start-up profile
        self.companion_seconds = companion_seconds or (lambda num_tokens: 0.0)
        # a companion head runs beside each draft forward (drafters/head_draft.py); a companion model once over all
        self.companion_in_lockstep = companion_in_lockstep
        # measured drafting time beyond the predicted, per chain a forward carries (the drafter's own work per request,
        # reading its states, drawing its token, building its draft, grows with the batch): the plain mean of the first
        # rounds, then a running mean, so that the first rounds price the next decisions at once (a head's round of 16
        # chains takes 5-11 ms against a 1 ms profile; learnt a tenth at a time, it kept drafting at a loss)
        self.draft_overhead_seconds = 0.0
        self._rounds_measured = 0
        self._batch = 1  # the requests drafting was last reserved for: a round's first forward carries each one's chain
        self._max_tokens = 1  # the most a request could draft last round: a steady first forward reads that + 1 at most
        self.steps_off = 0  # steps the planner kept drafting off since the last probe
        self.probes_off = 0  # probes since the planner last chose to draft
        # what the last probe took, measured: its first forward read what the model missed while off, so it costs
        # more than a steady round, the more the longer drafting was off; the next probe is budgeted at it
        self.probe_seconds = 0.0
        self._probing = False  # the drafting just reserved is a probe
        self._sampling = False  # ... or a probe or an exploring round: it drafts for a sample of the batch
        self._sampled: set[str] = set()  # the requests the last such round drafted for
        self._round_saving = 0.0  # the seconds a round the planner chose to draft is expected to save a request
        self._off: tuple[tuple, OffDecision, int] | None = None  # (batch, the decision, steps it still holds) last
        # this round's (seconds a yielded token is worth, the learnt acceptance of a token after the first) where the
        # planner chose to draft with a model that knows its acceptance; None: its chains are not cut short
        self._round_prices: tuple[float, float] | None = None
        self._source = ""  # the source drafting was last reserved for
        # the model's last drafts that carried its own estimates: (each node's path probability, forwards it took)
        self.recent_drafts: deque[tuple[list[float], int]] = deque(maxlen=DRAFTS_KEPT)
        self.selective_loss = 0.0  # what a round of such a model was expected to lose when the planner last declined it

    def reserve(
        self, reqs: list[Request], max_tokens: int, source: str, beside: Sequence[tuple[Request, Draft]] = (),
        knows_acceptance: bool = False, unread: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """Per request id, how many tokens it drafts with SOURCE's model next; their KV blocks are reserved. BESIDE: the
        rest of the batch's decoding requests, with the drafts they have. UNREAD: per request id, the tokens the model
        has not read of it (none given: it read all but the last). KNOWS_ACCEPTANCE: the model estimates each
        greedy token's acceptance as it drafts it (an EAGLE head's own probability, drafters/head_draft.py), so once
        the planner chooses to draft, a greedy request may draft up to MAX_TOKENS and stops where its path's estimate
        is no longer worth a forward (`continuing`)."""
        self._source, self._max_tokens = source, max_tokens
        depth, chosen = self._depth(reqs, max_tokens, source, beside, knows_acceptance)
        deepest = max_tokens if knows_acceptance and chosen else depth
        unread = unread or {}
        if self._sampling:
            drafting = self._probe_sample(reqs, unread)
        elif chosen:
            drafting = {req.request_id for req in reqs if self._worth_catching_up(req, unread.get(req.request_id, 1))}
        else:
            drafting = {req.request_id for req in reqs}
        self._batch = max(len(drafting), 1)
        return {
            req.request_id: self._reserve(
                req, min(depth if req.sampled else deepest, draft_depth_limit(req, self.max_model_len)))
            if req.request_id in drafting else 0
            for req in reqs
        }

    def _probe_sample(self, reqs: list[Request], unread: Mapping[str, int]) -> set[str]:
        """The ids of the requests a probe or an exploring round drafts for: PROBE_REQUESTS at most, those the model
        has read the most of first, then those the last such round drafted for, then the batch's order."""
        ordered = sorted(reqs, key=lambda req: (unread.get(req.request_id, 1), req.request_id not in self._sampled))
        self._sampled = {req.request_id for req in ordered[:PROBE_REQUESTS]}
        return self._sampled

    def _worth_catching_up(self, req: Request, unread: int) -> bool:
        """Whether the request drafts in a round the planner chose: a steady one (its model read all but what a step
        can accept) does; one the model fell behind on where reading the UNREAD tokens once costs less than the
        round's saving for a request, times the tokens the request may still generate."""
        if unread <= self._max_tokens + 1:
            return True
        catching_up = self.draft_seconds(unread) - self.draft_seconds(1)
        return catching_up <= self._round_saving * (draft_depth_limit(req, self.max_model_len) + 1)

    def observe_drafting_seconds(
        self, seconds: float, draft_forwards: Sequence[int], companion_forwards: Sequence[int] = (),
    ) -> None:
        """The measured SECONDS of a round of drafting whose draft-model forwards carried DRAFT_FORWARDS tokens each
        (and the companion's COMPANION_FORWARDS): the draft's overhead per chain learns from a steady round, a forward
        carrying as many chains as the batch it was reserved for, or as its tokens where fewer (later forwards carry
        one token for each chain that goes on). A round whose first forward reads more than a step can have accepted
        (a prompt, or what a stretch off left unread) teaches nothing: the profile prices a forward of n tokens with
        n rows of logits, and such a forward computes one a chain, so its error is the profile's (a head's catch-up
        over 1,700 prompt tokens took a fifth of the price, and the overhead it taught made drafting look free)."""
        if self._probing:
            self.probe_seconds, self._probing = seconds, False
        if not draft_forwards or self.draft_seconds is None:
            return
        if draft_forwards[0] > self._batch * (self._max_tokens + 1):
            return
        predicted = sum(map(self.draft_seconds, draft_forwards)) + sum(map(self.companion_seconds, companion_forwards))
        chains = sum(min(tokens, self._batch) for tokens in draft_forwards)
        error = seconds - predicted - chains * self.draft_overhead_seconds
        self._rounds_measured += 1
        self.draft_overhead_seconds += max(OVERHEAD_SMOOTHING, 1 / self._rounds_measured) * error / chains

    def observe_draft(self, draft: Draft) -> None:
        """A draft proposed for the next step: where it is the model's and carries the model's own estimates, its
        nodes' path probabilities and the forwards that drafted it (its depth, or more where a tree's deepest nodes
        were not kept) are kept for the decisions to come."""
        if draft.source == self._source and draft.acceptance and len(draft):
            paths = path_probabilities(PlannedTree(draft.parents, draft.acceptance))
            self.recent_drafts.append((paths, max(draft.forwards, *depths(draft.parents))))

    def _depth(
        self, reqs: list[Request], max_tokens: int, source: str, beside: Sequence[tuple[Request, Draft]],
        knows_acceptance: bool = False,
    ) -> tuple[int, bool]:
        """The batch's depth, and whether the planner chose it (not a probe, not the fixed depth without a planner)."""
        self._round_prices, self._sampling = None, False
        if self.target_seconds is None or self.draft_seconds is None or not reqs:
            return max_tokens, False
        off = self._kept_off(reqs, beside)
        if off is None:
            batch = len(reqs)
            rest_tokens, rest_expected = self._rest(beside)
            step_seconds = self._step_seconds(batch, rest_tokens, self.draft_overhead_seconds)
            selective = knows_acceptance and not any(req.sampled for req in reqs)
            decision, depth = self._decide(reqs, max_tokens, source, rest_tokens, rest_expected, step_seconds,
                                           selective)
            if decision in (DRAFT, EXPLORE):
                self._sampling = decision == EXPLORE
                if decision == DRAFT:
                    self.steps_off = self.probes_off = 0
                    self.probe_seconds = 0.0
                if selective:
                    self._round_prices = self._prices(reqs, source, step_seconds(0), rest_expected)
                return depth, True
            off = OffDecision(decision, step_seconds(0), self._probe_price(batch, selective), selective)
            self._off = (_batch_key(reqs, beside), off, KEEP_OFF_STEPS)
        if off.decision == NEVER:
            return 0, False
        depth = self._probe_depth(off.step_seconds, off.probe_seconds)
        if depth:
            # the probe's outcome changes the estimates: decide afresh after it
            self._off, self._probing, self._sampling = None, True, True
            if off.selective:  # its estimates are as old as the off decision: it drafts until it has fresh ones
                self.recent_drafts.clear()
        return depth, False

    def _probe_price(self, batch: int, selective: bool) -> float:
        """The seconds a probe of BATCH requests is budgeted at: what the last probe took where that is more than a
        round of one token; a probe of a model that knows its acceptance drafts until it has fresh drafts, each round
        expected to lose what its gain lacks."""
        sample = min(batch, PROBE_REQUESTS)
        if selective:
            return max(self.probe_seconds, -(-DRAFTS_TRUSTED // sample) * sample / batch * self.selective_loss)
        return max(self._drafting_seconds(1, sample), self.probe_seconds)

    def _prices(self, reqs: list[Request], source: str, step_seconds: float, rest_expected: float) -> tuple:
        """(the seconds a token the step yields is worth, the learnt acceptance of a drafted token given its parent's
        at depth 2)."""
        first, second = self._mean_path_probabilities(reqs, 2, source)
        return step_seconds / (rest_expected + len(reqs)), second / max(first, 1e-9)

    def continuing(self, path_probabilities: Sequence[float]) -> list[bool]:
        """Which of the greedy chains (or a tree's ends, several of one request) a model that knows its acceptance
        drafts this round go on to one more token, by the probabilities of their paths so far: the likeliest, as many
        as together are expected to gain what the forward drafting their next tokens costs (each next token is
        accepted with its path's probability times the learnt rate after the first). Verifying the tokens is the
        verification planner's choice, so no row is priced here. Every chain goes on where the planner did not choose
        this round's depth."""
        if self._round_prices is None:
            return [True] * len(path_probabilities)
        token_seconds, next_rate = self._round_prices
        order = sorted(range(len(path_probabilities)), key=lambda i: -path_probabilities[i])
        gain, count = 0.0, 0
        for chains, i in enumerate(order, start=1):
            gain += path_probabilities[i] * next_rate * token_seconds
            if gain >= self._drafting_seconds(1, chains):
                count = chains
        going = set(order[:count])
        return [i in going for i in range(len(path_probabilities))]

    def _decide(
        self, reqs: list[Request], max_tokens: int, source: str, rest_tokens: int, rest_expected: float,
        step_seconds: Callable[[int], float], selective: bool = False,
    ) -> tuple[str, int]:
        """(DRAFT, the depth with the best expected goodput), or (OFF, 0) where that depth is 0, or (NEVER, 0) where
        not even a draft the target always accepts would pay. SELECTIVE: the model's drafts carry its own estimates,
        and the batch drafts where its recent drafts say that pays (`_selective_round`), or to gather them
        (EXPLORE) while it has fewer than DRAFTS_TRUSTED."""
        batch = len(reqs)
        # were every drafted token accepted, at no more than the profiled draft cost (the overhead learnt while drafting
        # may be out of date once drafting stops): if even that does not pay, no acceptance can, and probing is waste
        cheapest = self._step_seconds(batch, rest_tokens, min(self.draft_overhead_seconds, 0.0))
        if not best_draft_depth([1.0] * max_tokens, batch, cheapest, rest_expected):
            return NEVER, 0
        if selective:
            if len(self.recent_drafts) < DRAFTS_TRUSTED:
                return EXPLORE, 1
            gain, cost = self._selective_round(batch, source, rest_tokens, step_seconds(0) / (rest_expected + batch))
            self.selective_loss = max(cost - gain, 0.0)
            self._round_saving = (gain - cost) / batch
            return (DRAFT, 1) if gain > cost else (OFF, 0)
        path_probs = self._mean_path_probabilities(reqs, max_tokens, source)
        depth = best_draft_depth(path_probs, batch, step_seconds, rest_expected)
        # the seconds the step at that depth saves against yielding its expected tokens without drafting
        expected = rest_expected + batch * (1 + sum(path_probs[:depth]))
        saved = expected * step_seconds(0) / (rest_expected + batch) - step_seconds(depth)
        self._round_saving = saved / batch
        return (DRAFT, depth) if depth else (OFF, 0)

    def _selective_round(self, batch: int, source: str, rest_tokens: int, token_seconds: float) -> tuple[float, float]:
        """(expected gain, cost) in seconds of a round in which BATCH requests draft, each drafted token verified only
        where its estimate pays for its row: a node whose path the model gives probability P gains max(0, f P - r)
        tokens, r a verified row's seconds in tokens (TOKEN_SECONDS: what a token the step yields is worth) and f the
        planner's calibration of the model's estimates; gains and forwards are averaged over the model's last drafts,
        which the same rule drafted (`continuing`)."""
        row_tokens = (self.target_seconds(rest_tokens + 2 * batch) - self.target_seconds(rest_tokens + batch)) / (
            batch * token_seconds)
        factor = self.estimator.factor(source, False)
        gain = sum(max(0.0, min(factor * p, 1.0) - row_tokens) for paths, _ in self.recent_drafts for p in paths)
        forwards = sum(depth for _, depth in self.recent_drafts)
        kept = len(self.recent_drafts)
        return batch * gain / kept * token_seconds, forwards / kept * self._drafting_seconds(1, batch)

    def _kept_off(self, reqs: list[Request], beside: Sequence[tuple[Request, Draft]]) -> OffDecision | None:
        """The off decision last made for this very batch, while it holds (KEEP_OFF_STEPS steps, no probe since);
        else None. Nothing it rests on changes while it holds (a probe or a measured round ends it), so a step it
        holds for prices nothing again."""
        if self._off is None:
            return None
        key, decision, steps_left = self._off
        if not steps_left or key != _batch_key(reqs, beside):
            self._off = None
            return None
        self._off = (key, decision, steps_left - 1)
        return decision

    def _step_seconds(self, batch: int, rest_tokens: int, draft_overhead: float) -> Callable[[int], float]:
        """A step's predicted seconds by depth when BATCH requests draft that deep beside REST_TOKENS verified for the
        rest of the batch, each draft forward costing DRAFT_OVERHEAD beyond the profile."""
        return lambda depth: (
            self.target_seconds(rest_tokens + batch * (1 + depth))
            + self._drafting_seconds(depth, batch, draft_overhead)
        )

    def _mean_path_probabilities(self, reqs: list[Request], max_tokens: int, source: str) -> list[float]:
        """[max_tokens] the probability that a drafted token at each depth is on the accepted path, over REQS."""
        probe = Draft([0] * max_tokens, source)
        by_request = [
            path_probabilities(PlannedTree(probe.parents, self.estimator.estimate(req, probe))) for req in reqs
        ]
        return [sum(column) / len(reqs) for column in zip(*by_request)]

    def _probe_depth(self, step_seconds: float, probe_seconds: float) -> int:
        """1 (a one-token probe) once the steps drafting stayed off have cost 1 / share times the probe, else 0."""
        self.steps_off += 1
        if self.steps_off * self.explore_share * step_seconds < probe_seconds:
            return 0
        self.steps_off = 0
        self.probes_off += 1
        return 1

    def _drafting_seconds(self, depth: int, batch: int, overhead: float | None = None) -> float:
        """Predicted seconds of BATCH requests drafting DEPTH tokens each, the companion's scoring included; OVERHEAD:
        per chain of a draft forward beyond the profile, the learnt one unless given."""
        if not depth:
            return 0.0
        overhead = self.draft_overhead_seconds if overhead is None else overhead
        per_forward = max(self.draft_seconds(batch) + batch * overhead, 1e-6)
        if self.companion_in_lockstep:
            return depth * (per_forward + self.companion_seconds(batch))
        return depth * per_forward + self.companion_seconds(batch * depth)

    def _rest(self, beside: Sequence[tuple[Request, Draft]]) -> tuple[int, float]:
        """Tokens the rest of the batch is expected to have verified, and to yield: each request's last token and
        the part of its draft the planner would verify."""
        if not beside:
            return 0, 0.0
        trees = [PlannedTree(draft.parents, self.estimator.estimate(req, draft)) for req, draft in beside]
        chosen = plan_verification(trees, len(trees), float(len(trees)), self.target_seconds)
        verified = len(trees) + sum(map(len, chosen))
        return verified, len(trees) + sum(expected_accepted(tree, nodes) for tree, nodes in zip(trees, chosen))

    @property
    def explore_share(self) -> float:
        """The share of the step time probes may take now: halved by every probe since drafting was last on."""
        return max(EXPLORE_SHARE / 2 ** self.probes_off, MIN_EXPLORE_SHARE)

    def _reserve(self, req: Request, num_tokens: int) -> int:
        """Grow the request's blocks to cover NUM_TOKENS drafted positions after its computed ones, or as many as
        the free blocks allow; returns how many it may draft."""
        start = req.num_computed_tokens  # the round's first forward computes the last token there
        if num_tokens <= 0:
            return 0
        return max(min(num_tokens, self.blocks.grow_towards(req.request_id, start + num_tokens) - start), 0)


def _batch_key(reqs: list[Request], beside: Sequence[tuple[Request, Draft]]) -> tuple:
    """What an off decision is kept for: the drafting requests, and the rest of the batch with its drafts' sizes."""
    return (tuple(req.request_id for req in reqs),
            tuple((req.request_id, len(draft)) for req, draft in beside))
