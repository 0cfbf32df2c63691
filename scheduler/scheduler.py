"""The scheduler: per step, who runs and which tokens their forward carries; after it, what verification did.

Plain data only: the scheduler imports no tensors and nothing of `engine/`, returns its
own records (scheduler/records.py), and can be tested without a model. Its jobs live
in their own modules: admission, the token budget and KV blocks (admission.py), which
drafted tokens are verified (draft_selection.py), and the update after verification
(update.py).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from drafters.base import Draft
from scheduler.acceptance import AcceptanceEstimator, CalibratedEstimator, TreeAcceptance
from scheduler.admission import Admission, QueueFullError
from scheduler.config import SchedulerConfig
from scheduler.draft_selection import DraftSelector, attach_draft
from scheduler.drafting_gate import DraftingGate
from scheduler.kv_blocks import KVBlockManager
from scheduler.latency import LatencyModel, StepOverhead
from scheduler.lookahead import LookaheadPlan
from scheduler.model_drafts import ModelDraftBudget
from scheduler.planner import num_extra_paths, prefill_worth
from scheduler.records import ScheduledRequest, SchedulerOutput, StepStats, StepUpdate, Verification
from scheduler.request import Request, RequestStatus
from scheduler.sessions import SessionStore
from scheduler.update import RequestUpdater, spec_step_stats

__all__ = ["QueueFullError", "Scheduler"]

class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        max_model_len: int,
        eos_token_ids: list[int],
        blocks: KVBlockManager,
        latency: LatencyModel | None = None,
        estimator: AcceptanceEstimator | None = None,
        sessions: SessionStore | None = None,
        draft_latency: LatencyModel | None = None,
        companion_latency: LatencyModel | None = None,
        companion_in_lockstep: bool = False,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.blocks = blocks
        self.latency = latency
        self.sessions = sessions
        self.estimator = CalibratedEstimator(
            estimator or TreeAcceptance(config.acceptance_prior, config.acceptance_prior_weight))
        self.admission = Admission(config, blocks, sessions)
        self.selector = DraftSelector(config, self.estimator, max_model_len)
        self.updater = RequestUpdater(max_model_len, eos_token_ids, blocks, self.estimator, self._finish)
        self.step_overhead = StepOverhead()  # measured step time minus the profiled forward time, by batch size
        planned = bool(latency and config.use_goodput_planner)
        self.model_drafts = ModelDraftBudget(
            self.estimator, blocks, max_model_len, self._step_seconds if planned else None, draft_latency,
            companion_latency, companion_in_lockstep,
        )
        # context drafters rest while the planner declines their drafts; a draft model has its own budget
        self.gate = DraftingGate() if planned and draft_latency is None else None

    @property
    def waiting(self):
        return self.admission.waiting

    @property
    def running(self) -> list[Request]:
        return self.admission.running

    @property
    def has_work(self) -> bool:
        return bool(self.admission.waiting or self.admission.running)

    # --- requests in and out -----------------------------------------------------------------
    def add_request(self, req: Request) -> str | None:
        """Queue a request; returns the key of the session whose drafter state it resumes (None: it starts afresh).

        Raises QueueFullError when the queue is full.
        """
        self.admission.add(req)
        return self.sessions.attach(req) if self.sessions else None

    def drop_cached_prefix(self, req: Request) -> None:
        """Compute a just-added request's whole prompt after all, instead of reading its cached prefix's KV."""
        if self.sessions:
            self.sessions.stats.reused_tokens -= req.num_cached_tokens
        self.blocks.free(req.request_id)
        req.num_computed_tokens = req.num_cached_tokens = 0

    def abort(self, request_id: str) -> Request | None:
        req = self.admission.remove(request_id)
        if req is not None:
            self._finish(req, "abort")
        return req

    def end_turn(self, request_id: str) -> str | None:
        """A finished request is gone; returns the key of the session its turn updated (None: no session)."""
        return self.sessions.end(request_id) if self.sessions else None

    def _finish(self, req: Request, reason: str) -> None:
        self.admission.finish(req, reason)
        self.estimator.forget(req.request_id)
        if self.gate:
            self.gate.forget(req.request_id)

    def reserve_model_drafts(
        self, reqs: list[Request], max_tokens: int, source: str, beside: Sequence[tuple[Request, Draft]] = (),
        knows_acceptance: bool = False, unread: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """Per request id, how many tokens it drafts with a model before the next step, BESIDE the rest of the batch's
        drafts (scheduler/model_drafts.py)."""
        return self.model_drafts.reserve(reqs, max_tokens, source, beside, knows_acceptance, unread)

    def chains_continuing(self, path_probabilities: Sequence[float]) -> list[bool]:
        """Which greedy chains of a model that knows its tokens' acceptance draft one more token this round."""
        return self.model_drafts.continuing(path_probabilities)

    def observe_drafting_seconds(
        self, seconds: float, draft_forwards: Sequence[int], companion_forwards: Sequence[int] = (),
    ) -> None:
        """What a round of model drafting took, measured, and the tokens each of its forwards carried."""
        self.model_drafts.observe_drafting_seconds(seconds, draft_forwards, companion_forwards)

    def drafting(self, reqs: list[Request]) -> list[Request]:
        """Of the decoding REQS, those that propose a draft for the next step; the others rest (their drafts
        cleared) while the planner keeps declining what they draft (scheduler/drafting_gate.py)."""
        if self.gate is None:
            return reqs
        proposing = []
        for req in reqs:
            if self.gate.proposes(req.request_id):
                proposing.append(req)
            else:
                req.draft = None
        return proposing

    def resting(self, reqs: list[Request]) -> list[Request]:
        """Of the decoding REQS, those `drafting` rested this step: they may offer what their drafter finds at next
        to no cost, which the gate does not count for or against their rest."""
        return [req for req in reqs if self.gate.resting(req.request_id)] if self.gate is not None else []

    def set_drafts(self, reqs: list[Request], drafts: list[Draft]) -> None:
        for req, draft in zip(reqs, drafts):
            req.draft = draft if len(draft) or draft.lookahead else None
            self.model_drafts.observe_draft(draft)

    # --- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.admission.admit_waiting()
        decoding = self.admission.schedule_decoding(out)
        self.admission.schedule_prefill_chunks(out)
        self._schedule_drafts(out, [item for item in decoding if item.req.status is RequestStatus.RUNNING])
        if self.latency:
            num_rows = out.num_verified_draft_tokens + out.num_lookahead_rows  # a prefill chunk's tokens are no rows
            out.predicted_seconds = self._batch_seconds(out.num_scheduled_tokens, len(self.admission.running),
                                                        num_rows) + self._extra_path_seconds(out)
        return out

    def _schedule_drafts(self, out: SchedulerOutput, decoding: list[ScheduledRequest]) -> None:
        """Spend what is left of the token budget on the drafted tokens worth verifying."""
        budget = self.config.max_num_batched_tokens - out.num_scheduled_tokens
        step_seconds = self._fixed_batch_seconds(len(self.admission.running), out.num_scheduled_tokens) \
            if self.latency else None
        path_seconds = self.latency.extra_path_seconds if self.latency else (lambda context_len: 0.0)
        worth = prefill_worth(out.num_scheduled_tokens, len(decoding), step_seconds) if step_seconds else 0.0
        chosen = self.selector.select(decoding, out.num_scheduled_tokens, budget, step_seconds, path_seconds, worth)
        for item, nodes in zip(decoding, chosen):
            req = item.req
            nodes = nodes[:max(self.admission.positions_available(req) - req.num_computed_tokens - 1, 0)]
            self.blocks.grow(req.request_id, req.num_computed_tokens + 1 + len(nodes))
            attach_draft(item, nodes)
            out.num_offered_draft_tokens += len(req.draft) if req.draft else 0
            out.offers_rows |= req.draft is not None  # set_drafts keeps only drafts with tokens or look-ahead
            out.num_verified_draft_tokens += len(nodes)
            out.expected_tokens += self.selector.expected_tokens(req, nodes)
        plan = LookaheadPlan(out, self.config.max_num_batched_tokens - out.num_scheduled_tokens,
                             step_seconds if self.config.use_goodput_planner else None, worth)
        for item in decoding:
            plan.choose(item, self._lookahead_room(item))
            if item.lookahead:  # scratch slots after the item's tokens: the update gives them back
                self.blocks.grow(item.req.request_id,
                                 item.req.num_computed_tokens + len(item.token_ids) + item.num_lookahead_rows)
            if self.gate and item.req.draft is not None:
                self.gate.record(item.req.request_id, len(item.req.draft) + len(item.req.draft.lookahead),
                                 len(item.draft_nodes) + len(item.lookahead))

    def _lookahead_room(self, item: ScheduledRequest) -> int:
        """Look-ahead rows the item may add: KV slots after its tokens, positions below the model's length."""
        req = item.req
        kv_room = self.admission.positions_available(req) - req.num_computed_tokens - len(item.token_ids)
        return min(kv_room, self.max_model_len - len(req.all_token_ids))

    def _extra_path_seconds(self, out: SchedulerOutput) -> float:
        """What the step's draft trees cost beyond their token count: their paths beyond the first."""
        return sum(
            num_extra_paths(item.draft_parents) * self.latency.extra_path_seconds(item.num_computed)
            for item in out.scheduled
        )

    def _step_seconds(self, num_tokens: int) -> float:
        """Predicted seconds of the next step, of the running requests carrying NUM_TOKENS (one each, the rest rows
        beyond their own)."""
        batch_size = len(self.admission.running)
        return self._batch_seconds(num_tokens, batch_size, max(num_tokens - batch_size, 0))

    def _fixed_batch_seconds(self, batch_size: int, num_base_tokens: int) -> Callable[[int], float]:
        """_batch_seconds for one BATCH_SIZE whose steps carry NUM_BASE_TOKENS before any row beyond them, its
        prices looked up once: the planner prices every prefix of a batch's drafted nodes with it."""
        per_step, per_row = self.step_overhead.prices(batch_size)
        return lambda num_tokens: max(
            self.latency(num_tokens) + per_step + per_row * max(num_tokens - num_base_tokens, 0), 1e-6)

    def _batch_seconds(self, num_tokens: int, batch_size: int, num_rows: int) -> float:
        """Predicted seconds of a step of BATCH_SIZE requests carrying NUM_TOKENS, NUM_ROWS of them beyond the
        requests' own (drafted, look-ahead): the start-up profile of one request's forward, plus what a real batch of
        that size costs on top of it (attention over every request's context, verification), as measured."""
        return max(self.latency(num_tokens) + self.step_overhead(batch_size, num_rows), 1e-6)

    def observe_step_seconds(self, out: SchedulerOutput, seconds: float) -> None:
        """Learn the overhead from steps that only decode and verify: a prefill chunk attends over a context
        unlike the profile's, and its error would skew the cost of the drafts the planner weighs."""
        if self.latency and out.scheduled and not out.has_prefill:
            batch_size = len(out.scheduled)
            num_rows = out.num_scheduled_tokens - batch_size
            predicted = self._batch_seconds(out.num_scheduled_tokens, batch_size, num_rows) \
                + self._extra_path_seconds(out)
            self.step_overhead.observe(batch_size, seconds - predicted, num_rows, predicted,
                                       offered=out.offers_rows)

    # --- after verification ----------------------------------------------------------------------
    def update(self, out: SchedulerOutput, results: list[Verification]) -> StepUpdate:
        """Append each request's verified tokens, release rejected KV, finish requests that stop.

        results: per scheduled request, what verifying it produced (empty tokens for a prefill chunk short of the end).
        """
        spec_by_drafter = spec_step_stats(out.scheduled, results)
        step = StepUpdate([], StepStats())
        for item, result in zip(out.scheduled, results):
            if item.reaches_end:
                update, moves = self.updater.update(item, result)
                step.updates.append(update)
                step.kv_moves += moves
            else:
                item.req.num_computed_tokens += len(item.token_ids)
        self.admission.running[:] = [req for req in self.admission.running if not req.is_finished]
        step.stats = StepStats(
            num_running=len(self.admission.running),
            num_waiting=len(self.admission.waiting),
            num_offered_draft_tokens=out.num_offered_draft_tokens,
            num_verified_draft_tokens=out.num_verified_draft_tokens,
            num_accepted_tokens=sum(s.num_accepted_tokens for s in spec_by_drafter.values()),
            spec_by_drafter=spec_by_drafter,
            planned_tokens=out.expected_tokens,
            planned_seconds=out.predicted_seconds,
            acceptance_calibration=self.estimator.factors(),
            num_generated_tokens=sum(len(u.new_token_ids) for u in step.updates),
            kv_cache_usage=self.blocks.usage,
            num_scheduled_tokens=out.num_scheduled_tokens,
            num_lookahead_rows=out.num_lookahead_rows,
            num_preemptions=len(out.preempted),
        )
        return step
