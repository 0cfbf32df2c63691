"""Request admission, per-step token decisions and bookkeeping after verification.

Plain data only: the scheduler imports no tensors and can be tested without a model.

One step, in order of priority:
1. every running request that is decoding advances by its one uncomputed token;
2. requests still prefilling (new, or recomputing after preemption) take prefill
   chunks from the token budget that is left, oldest first;
3. the goodput planner spends what is left of the budget on drafted tokens.

Fairness: waiting requests are admitted strictly first come, first served, so no
waiting request is ever passed over by a later one; a request that runs out of KV
blocks takes them from the youngest running request (preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed), never from an
older one, so the oldest request always progresses and every request finishes.

Cached sessions (an optional `TurnCache`) hold the KV blocks of finished turns; they
always give way: before a request waits for blocks or preempts another, the cache is
asked to release blocks, least recently used sessions first.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from drafters.base import Draft
from engine.wire import DraftStepStats, RequestOutput, StepStats
from scheduler.acceptance import AcceptanceEstimator, PositionalAcceptance
from scheduler.config import SchedulerConfig
from scheduler.kv_blocks import KVBlockManager
from scheduler.latency import LatencyModel
from scheduler.planner import expected_tokens, plan_verification
from scheduler.request import Request, RequestStatus


OVERHEAD_SMOOTHING = 0.1  # weight of the latest step in the running mean of the measured step overhead
PROBE_INTERVAL_STEPS = 16  # steps in a row a request's drafts may go unverified before it verifies one anyway


class QueueFullError(RuntimeError):
    pass


class TurnCache(Protocol):
    """What keeps finished turns for the next turn of their conversation (engine/sessions.py)."""

    def keep(self, req: Request, block_ids: list[int]) -> None:
        """A request is finishing: its blocks are about to be freed, so hold what is worth keeping."""

    def reclaim(self, num_blocks: int) -> None:
        """Release held blocks, least recently used first, until `num_blocks` more are free or none is held."""


@dataclass
class ScheduledRequest:
    req: Request
    input_token_ids: list[int]  # [num_uncomputed in this step + num_draft] tokens this forward carries
    num_draft_tokens: int = 0  # drafted tokens at the end of input_token_ids, to be verified
    reaches_end: bool = True  # False for a prefill chunk that stops short of the request's last token

    @property
    def is_prefill(self) -> bool:
        return not self.reaches_end or len(self.input_token_ids) > self.num_draft_tokens + 1

    @property
    def num_logits(self) -> int:
        """Positions whose next-token distribution is needed: the last real token and each draft."""
        return self.num_draft_tokens + 1 if self.reaches_end else 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.input_token_ids[len(self.input_token_ids) - self.num_draft_tokens:]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_offered_draft_tokens: int = 0
    num_verified_draft_tokens: int = 0
    expected_tokens: float = 0.0  # the planner's estimate of the tokens this step yields
    predicted_seconds: float = 0.0  # the latency model's estimate of this step's forward
    num_preemptions: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(item.input_token_ids) for item in self.scheduled)

    @property
    def has_prefill(self) -> bool:
        return any(item.is_prefill for item in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        max_model_len: int,
        eos_token_ids: list[int],
        blocks: KVBlockManager,
        latency: LatencyModel | None = None,
        estimator: AcceptanceEstimator | None = None,
        turn_cache: TurnCache | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.blocks = blocks
        self.latency = latency
        self.estimator = estimator or PositionalAcceptance(config.acceptance_prior, config.acceptance_prior_weight)
        self.turn_cache = turn_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first
        self.step_overhead_seconds = 0.0  # running mean of measured step time minus the profiled forward time

    # --- admission -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"the server is at capacity: {self.config.max_waiting} requests are already waiting; retry later"
            )
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._finish(req, "abort")
                    return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._admit_waiting()
        decoding = self._schedule_decoding(out)
        self._schedule_prefill_chunks(out)
        self._schedule_drafts(out, decoding)
        if self.latency:
            out.predicted_seconds = self._step_seconds(out.num_scheduled_tokens)
        return out

    def _step_seconds(self, num_tokens: int) -> float:
        """Predicted seconds of a step: the start-up profile of one request's forward, plus what a real batch
        costs on top of it (attention over every request's context, verification, drafting), as measured."""
        return max(self.latency(num_tokens) + self.step_overhead_seconds, 1e-6)

    def observe_step_seconds(self, out: SchedulerOutput, seconds: float) -> None:
        """Learn the overhead from steps that only decode and verify: a prefill chunk attends over a context
        unlike the profile's, and its error would skew the cost of the drafts the planner weighs."""
        if self.latency and out.scheduled and not out.has_prefill:
            error = seconds - self._step_seconds(out.num_scheduled_tokens)
            self.step_overhead_seconds += OVERHEAD_SMOOTHING * error

    def _admit_waiting(self) -> None:
        """First come, first served: the head of the queue joins once a seat and its first chunk's blocks are free."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            head = self.waiting[0]
            first_chunk = min(head.num_uncomputed_tokens, self.config.max_num_batched_tokens)
            if not self._make_room(head, head.num_computed_tokens + first_chunk):
                return
            self.waiting.popleft()
            head.status = RequestStatus.RUNNING
            bisect.insort(self.running, head, key=lambda req: req.arrival_time)

    def _schedule_decoding(self, out: SchedulerOutput) -> list[ScheduledRequest]:
        """Every decoding request advances by its last token, oldest first; blocks come from the youngest."""
        decoding = []
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or req.num_uncomputed_tokens != 1:
                continue
            if self._reserve_blocks(req, req.num_computed_tokens + 1, out):
                decoding.append(ScheduledRequest(req, req.all_token_ids[-1:]))
        out.scheduled += decoding
        return decoding

    def _schedule_prefill_chunks(self, out: SchedulerOutput) -> None:
        """Requests still prefilling take chunks from the budget the decoding requests left, oldest first."""
        budget = self.config.max_num_batched_tokens - out.num_scheduled_tokens
        for req in list(self.running):
            if budget <= 0:
                return
            if req.status is not RequestStatus.RUNNING or req.num_uncomputed_tokens == 1:
                continue
            self._make_room(req, req.num_computed_tokens + min(req.num_uncomputed_tokens, budget))
            chunk = self._chunk_that_fits(req, budget)
            if chunk <= 0 and self._reserve_blocks(req, req.num_computed_tokens + 1, out):
                chunk = self._chunk_that_fits(req, budget)  # younger requests gave their blocks back
            if chunk <= 0:
                continue
            end = req.num_computed_tokens + chunk
            self.blocks.grow(req.request_id, end)
            reaches_end = end == len(req.all_token_ids)
            out.scheduled.append(ScheduledRequest(req, req.all_token_ids[req.num_computed_tokens:end], 0, reaches_end))
            out.expected_tokens += 1.0 if reaches_end else 0.0
            budget -= chunk

    def _chunk_that_fits(self, req: Request, budget: int) -> int:
        """Prefill tokens the request can take now: bounded by what it lacks, the budget and the free blocks."""
        return min(req.num_uncomputed_tokens, budget, self._positions_available(req) - req.num_computed_tokens)

    def _schedule_drafts(self, out: SchedulerOutput, decoding: list[ScheduledRequest]) -> None:
        """Spend what is left of the token budget on the drafted tokens the planner expects to pay off."""
        live = [item for item in decoding if item.req.status is RequestStatus.RUNNING]
        out.scheduled = [item for item in out.scheduled if item.req.status is RequestStatus.RUNNING]
        limits = [self._draft_limit(item.req) for item in live]
        acceptance = [self.estimator.estimate(item.req, limit) if limit else [] for item, limit in zip(live, limits)]
        budget = self.config.max_num_batched_tokens - out.num_scheduled_tokens
        if self.latency and self.config.use_goodput_planner:
            chosen = plan_verification(acceptance, out.num_scheduled_tokens, len(live), self._step_seconds, budget)
            chosen = _probe_long_unverified(live, limits, chosen, budget)
        else:
            chosen = _first_come(limits, budget)
        for item, rates, num_drafts in zip(live, acceptance, chosen):
            req = item.req
            num_drafts = min(num_drafts, self._positions_available(req) - req.num_computed_tokens - 1)
            self.blocks.grow(req.request_id, req.num_computed_tokens + 1 + num_drafts)
            item.input_token_ids = item.input_token_ids + req.draft_token_ids[:num_drafts]
            item.num_draft_tokens = num_drafts
            out.num_offered_draft_tokens += len(req.draft_token_ids)
            out.num_verified_draft_tokens += num_drafts
            out.expected_tokens += expected_tokens(rates[:num_drafts])[num_drafts]

    def _draft_limit(self, req: Request) -> int:
        """Drafted tokens worth considering: no more than the request may still generate."""
        room = min(req.max_new_tokens_left, self.max_model_len - len(req.all_token_ids)) - 1
        return max(min(len(req.draft_token_ids), room), 0)

    # --- KV blocks and preemption --------------------------------------------------------
    def _make_room(self, req: Request, num_positions: int) -> bool:
        """Whether the free blocks let the request cover `num_positions`, after cached sessions gave theirs back."""
        missing = self.blocks.num_new_blocks(req.request_id, num_positions) - self.blocks.num_free_blocks
        if missing > 0 and self.turn_cache:
            self.turn_cache.reclaim(missing)
        return self.blocks.can_grow(req.request_id, num_positions)

    def _positions_available(self, req: Request) -> int:
        """Positions the request could cover with the blocks it owns plus every free block."""
        owned = len(self.blocks.block_tables.get(req.request_id, ()))
        return (owned + self.blocks.num_free_blocks) * self.blocks.block_size

    def _reserve_blocks(self, req: Request, num_positions: int, out: SchedulerOutput) -> bool:
        """Make the request's blocks cover `num_positions`, preempting younger requests if need be.

        Returns False when even that is not enough; the request itself is then preempted
        if it is the youngest, or simply waits for this step otherwise.
        """
        while not self._make_room(req, num_positions):
            victim = self.running[-1]
            if victim is req and req.num_uncomputed_tokens == 1:
                self._preempt(req, out)
                return False
            if victim is req:
                return False
            self._preempt(victim, out)
        self.blocks.grow(req.request_id, num_positions)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free the request's blocks and queue it at the front; it is recomputed from its tokens later."""
        self.blocks.free(req.request_id)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = req.num_cached_tokens = 0  # recomputed in full, cached prefix included
        req.draft_token_ids = []
        self.waiting.appendleft(req)
        out.num_preemptions += 1

    def set_drafts(self, reqs: list[Request], drafts: list[Draft]) -> None:
        for req, draft in zip(reqs, drafts):
            req.draft_token_ids = draft.token_ids
            req.draft_source = draft.source

    # --- after verification ----------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[list[int]]) -> tuple[list[RequestOutput], StepStats]:
        """Append each request's accepted drafts plus its bonus token; release rejected KV; finish requests that stop.

        sampled: per scheduled request, the tokens verification produced ([] for a prefill chunk short of the end).
        """
        spec_by_drafter = _spec_step_stats(out.scheduled, sampled)
        outputs = []
        for item, token_ids in zip(out.scheduled, sampled):
            if item.reaches_end:
                outputs.append(self._update_one(item, token_ids))
            else:
                item.req.num_computed_tokens += len(item.input_token_ids)
        self.running = [req for req in self.running if not req.is_finished]
        stats = StepStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_offered_draft_tokens=out.num_offered_draft_tokens,
            num_verified_draft_tokens=out.num_verified_draft_tokens,
            num_accepted_tokens=sum(s.num_accepted_tokens for s in spec_by_drafter.values()),
            spec_by_drafter=spec_by_drafter,
            planned_tokens=out.expected_tokens,
            planned_seconds=out.predicted_seconds,
            num_generated_tokens=sum(len(o.new_token_ids) for o in outputs),
            kv_cache_usage=self.blocks.usage,
            num_scheduled_tokens=out.num_scheduled_tokens,
            num_preemptions=out.num_preemptions,
        )
        return outputs, stats

    def _update_one(self, item: ScheduledRequest, token_ids: list[int]) -> RequestOutput:
        req = item.req
        self._record_speculation(item, num_accepted=len(token_ids) - 1)
        new_token_ids, stop_reason = self._append_until_stop(req, token_ids)
        req.num_computed_tokens = len(req.all_token_ids) - 1  # the last token and the accepted drafts are in the cache
        req.draft_token_ids = []
        if stop_reason:
            self._finish(req, stop_reason)
        else:
            self.blocks.shrink(req.request_id, req.num_computed_tokens + 1)  # rejected drafts' KV goes back
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_token_ids,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            spec=req.spec,  # running totals, so a request closed early still reports them
            num_cached_tokens=req.num_cached_tokens,
        )

    def _record_speculation(self, item: ScheduledRequest, num_accepted: int) -> None:
        if item.num_draft_tokens == 0:
            return
        spec = item.req.spec
        spec.num_drafts += 1
        spec.num_draft_tokens += item.num_draft_tokens
        spec.num_accepted_tokens += num_accepted
        self.estimator.observe(item.req, item.num_draft_tokens, num_accepted)

    def _append_until_stop(self, req: Request, token_ids: list[int]) -> tuple[list[int], str | None]:
        """Append tokens up to and including the first that stops the request; returns them and the stop reason."""
        appended = []
        for token_id in token_ids:
            req.all_token_ids.append(token_id)
            appended.append(token_id)
            reason = self._stop_reason(req, token_id)
            if reason:
                return appended, reason
        return appended, None

    def _stop_reason(self, req: Request, token_id: int) -> str | None:
        if token_id in self.eos_token_ids and not req.sampling.ignore_eos:
            return "stop"
        if token_id in req.sampling.stop_token_ids:
            return "stop"
        if req.num_output_tokens >= req.sampling.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if self.turn_cache and req.request_id in self.blocks.block_tables:
            self.turn_cache.keep(req, self.blocks.block_tables[req.request_id])
        self.blocks.free(req.request_id)


def _probe_long_unverified(live: list[ScheduledRequest], limits: list[int], chosen: list[int], budget: int) -> list[int]:
    """Acceptance estimates learn only from verified drafts, so a drafter whose first drafts failed could go
    unverified for good; a request whose drafts went unverified PROBE_INTERVAL_STEPS steps in a row verifies one."""
    probed, room = list(chosen), budget - sum(chosen)
    for i, (item, limit) in enumerate(zip(live, limits)):
        req = item.req
        if chosen[i] > 0:
            req.num_steps_unverified = 0
        elif limit > 0:
            req.num_steps_unverified += 1
            if req.num_steps_unverified >= PROBE_INTERVAL_STEPS and room > 0:
                probed[i], room, req.num_steps_unverified = 1, room - 1, 0
    return probed


def _first_come(limits: list[int], budget: int) -> list[int]:
    """Without the planner: every drafted token, in request order, while the budget lasts."""
    chosen = []
    for limit in limits:
        chosen.append(min(limit, max(budget, 0)))
        budget -= chosen[-1]
    return chosen


def _spec_step_stats(scheduled: list[ScheduledRequest], sampled: list[list[int]]) -> dict[str, DraftStepStats]:
    """Per drafter: how many drafted tokens were verified and accepted this step, and at which positions."""
    by_drafter: dict[str, DraftStepStats] = {}
    for item, token_ids in zip(scheduled, sampled):
        if item.num_draft_tokens == 0:
            continue
        stats = by_drafter.setdefault(item.req.draft_source, DraftStepStats(num_accepted_per_position=[]))
        num_accepted = len(token_ids) - 1
        stats.num_drafts += 1
        stats.num_draft_tokens += item.num_draft_tokens
        stats.num_accepted_tokens += num_accepted
        per_position = stats.num_accepted_per_position
        per_position.extend([0] * (item.num_draft_tokens - len(per_position)))
        for position in range(num_accepted):
            per_position[position] += 1
    return by_drafter
