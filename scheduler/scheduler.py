"""Request admission, per-step token decisions and bookkeeping after verification.

Plain data only: the scheduler imports no tensors and can be tested without a model.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from drafters.base import Draft
from engine.wire import DraftStepStats, RequestOutput, StepStats
from scheduler.acceptance import AcceptanceEstimator, PositionalAcceptance
from scheduler.config import SchedulerConfig
from scheduler.latency import LatencyModel
from scheduler.planner import best_num_draft_tokens, expected_tokens
from scheduler.request import Request, RequestStatus


class QueueFullError(RuntimeError):
    pass


@dataclass
class ScheduledRequest:
    req: Request
    input_token_ids: list[int]  # [num_uncomputed + num_draft] tokens this forward carries
    num_draft_tokens: int  # drafted tokens at the end of input_token_ids, to be verified

    @property
    def num_logits(self) -> int:
        """Positions whose next-token distribution is needed: the last real token and each draft."""
        return self.num_draft_tokens + 1

    @property
    def draft_token_ids(self) -> list[int]:
        return self.input_token_ids[len(self.input_token_ids) - self.num_draft_tokens:]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_offered_draft_tokens: int = 0
    num_verified_draft_tokens: int = 0
    expected_tokens: float = 0.0  # the planner's estimate of the tokens this step yields
    predicted_seconds: float = 0.0  # the latency model's estimate of this step's forwards


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        max_model_len: int,
        eos_token_ids: list[int],
        latency: LatencyModel | None = None,
        estimator: AcceptanceEstimator | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.latency = latency if config.use_goodput_planner else None
        self.estimator = estimator or PositionalAcceptance(config.acceptance_prior, config.acceptance_prior_weight)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # --- admission -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
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
        self._admit_waiting()
        out = SchedulerOutput()
        for req in self.running:
            num_drafts, expected = self._plan(req)
            uncomputed = req.all_token_ids[req.num_computed_tokens:]
            out.scheduled.append(ScheduledRequest(req, uncomputed + req.draft_token_ids[:num_drafts], num_drafts))
            out.num_offered_draft_tokens += len(req.draft_token_ids)
            out.num_verified_draft_tokens += num_drafts
            out.expected_tokens += expected
            out.predicted_seconds += self.latency(len(out.scheduled[-1].input_token_ids)) if self.latency else 0.0
        return out

    def _admit_waiting(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _plan(self, req: Request) -> tuple[int, float]:
        """Drafted tokens to verify, and the tokens the step is expected to yield for the request."""
        room = min(req.max_new_tokens_left, self.max_model_len - len(req.all_token_ids)) - 1
        limit = min(len(req.draft_token_ids), max(room, 0))
        if req.num_uncomputed_tokens != 1 or limit == 0:
            return 0, 1.0  # prefill steps carry no drafts
        acceptance = self.estimator.estimate(req, limit)
        num_drafts = limit if self.latency is None else best_num_draft_tokens(acceptance, self.latency)
        return num_drafts, expected_tokens(acceptance)[num_drafts]

    def set_drafts(self, reqs: list[Request], drafts: list[Draft]) -> None:
        for req, draft in zip(reqs, drafts):
            req.draft_token_ids = draft.token_ids
            req.draft_source = draft.source

    # --- after verification ----------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[list[int]]) -> tuple[list[RequestOutput], StepStats]:
        """Append each request's accepted drafts plus its bonus token; finish requests that stop."""
        spec_by_drafter = _spec_step_stats(out.scheduled, sampled)
        outputs = [self._update_one(item, token_ids) for item, token_ids in zip(out.scheduled, sampled)]
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
        )
        return outputs, stats

    def _update_one(self, item: ScheduledRequest, token_ids: list[int]) -> RequestOutput:
        req = item.req
        self._record_speculation(item, num_accepted=len(token_ids) - 1)
        new_token_ids = self._append_until_stop(req, token_ids)
        req.num_computed_tokens = len(req.all_token_ids) - 1
        req.draft_token_ids = []
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_token_ids,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            spec=req.spec,  # running totals, so a request closed early still reports them
        )

    def _record_speculation(self, item: ScheduledRequest, num_accepted: int) -> None:
        if item.num_draft_tokens == 0:
            return
        spec = item.req.spec
        spec.num_drafts += 1
        spec.num_draft_tokens += item.num_draft_tokens
        spec.num_accepted_tokens += num_accepted
        self.estimator.observe(item.req, item.num_draft_tokens, num_accepted)

    def _append_until_stop(self, req: Request, token_ids: list[int]) -> list[int]:
        appended = []
        for token_id in token_ids:
            req.all_token_ids.append(token_id)
            appended.append(token_id)
            reason = self._stop_reason(req, token_id)
            if reason:
                self._finish(req, reason)
                break
        return appended

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
