"""Who runs and what they compute: admission, the token budget's prefill chunks, KV blocks and preemption.

One step, in order of priority: (1) every running request that is decoding advances by its one uncomputed token;
(2) requests still prefilling (new, or recomputing after preemption) take prefill chunks from the token budget that
is left, oldest first; (3) the goodput planner (scheduler/draft_selection.py) spends what is left on drafted tokens.

Fairness: waiting requests are admitted strictly first come, first served, so no waiting request is passed over by a
later one; a request that runs out of KV blocks takes them from the youngest running request (preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed), never from an older one, so the oldest
request always progresses and every request finishes. The choices of one request (`n`) share its prompt's KV: a later
choice waits at the head of the queue until the first choice has computed the prompt's full blocks, then reads them
(computing only the prompt's last, partial block); if the first choice is not running, it computes the prompt itself.
Cached sessions (scheduler/sessions.py) hold the KV blocks of finished turns and always give way: before a request
waits for blocks or preempts another, the cache releases blocks, least recently used sessions first.
"""
from __future__ import annotations

import bisect
from collections import deque

from scheduler.config import SchedulerConfig
from scheduler.kv_blocks import KVBlockManager
from scheduler.records import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.sessions import SessionStore


class QueueFullError(RuntimeError):
    """The waiting queue is full (--max-waiting): the request is refused, and the server answers 429."""


class Admission:
    def __init__(self, config: SchedulerConfig, blocks: KVBlockManager, sessions: SessionStore | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.sessions = sessions
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first

    # --- requests in and out ---------------------------------------------------------------
    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"the server is at capacity: {self.config.max_waiting} requests are already waiting; retry later"
            )
        self.waiting.append(req)

    def remove(self, request_id: str) -> Request | None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    return req
        return None

    def finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if self.sessions and req.request_id in self.blocks.block_tables:
            self.sessions.keep(req, self.blocks.block_tables[req.request_id])
        self.blocks.free(req.request_id)

    # --- one step ----------------------------------------------------------------------------
    def admit_waiting(self) -> None:
        """First come, first served: the head of the queue joins once a seat and its first chunk's blocks are free."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            head = self.waiting[0]
            if not self._share_source_prompt(head):
                return
            first_chunk = min(head.num_uncomputed_tokens, self.config.max_num_batched_tokens)
            if not self._make_room(head, head.num_computed_tokens + first_chunk):
                return
            self.waiting.popleft()
            head.status = RequestStatus.RUNNING
            bisect.insort(self.running, head, key=lambda req: req.arrival_time)

    def _share_source_prompt(self, req: Request) -> bool:
        """Point a later choice at its first choice's prompt blocks; False while those are still being computed."""
        source = next((r for r in self.running if r.request_id == req.prompt_source), None)
        num_blocks = (req.num_prompt_tokens - 1) // self.blocks.block_size  # the last prompt token is always computed
        if source is None or req.num_computed_tokens or not num_blocks:
            req.prompt_source = None
            return True
        if source.num_computed_tokens < num_blocks * self.blocks.block_size:
            return False
        self.blocks.share(req.request_id, self.blocks.block_tables[source.request_id][:num_blocks])
        req.num_computed_tokens = req.num_cached_tokens = num_blocks * self.blocks.block_size
        req.prompt_source = None
        return True

    def schedule_decoding(self, out: SchedulerOutput) -> list[ScheduledRequest]:
        """Every decoding request advances by its last token, oldest first; blocks come from the youngest."""
        decoding = []
        for req in list(self.running):
            if req.is_decoding and self._reserve_blocks(req, req.num_computed_tokens + 1, out):
                decoding.append(self._scheduled(req, req.num_computed_tokens + 1))
        out.scheduled += decoding
        return decoding

    def schedule_prefill_chunks(self, out: SchedulerOutput) -> None:
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
            out.scheduled.append(self._scheduled(req, end))
            out.expected_tokens += 1.0 if end == len(req.all_token_ids) else 0.0
            budget -= chunk

    def _scheduled(self, req: Request, end: int) -> ScheduledRequest:
        return ScheduledRequest(
            req, req.all_token_ids[req.num_computed_tokens:end], req.num_computed_tokens,
            self.blocks.block_tables[req.request_id], reaches_end=end == len(req.all_token_ids),
        )

    def _chunk_that_fits(self, req: Request, budget: int) -> int:
        """Prefill tokens the request can take now: bounded by what it lacks, the budget and the free blocks."""
        return min(req.num_uncomputed_tokens, budget, self.positions_available(req) - req.num_computed_tokens)

    # --- KV blocks and preemption --------------------------------------------------------
    def _make_room(self, req: Request, num_positions: int) -> bool:
        """Whether the free blocks let the request cover `num_positions`, after cached sessions gave theirs back."""
        missing = self.blocks.num_new_blocks(req.request_id, num_positions) - self.blocks.num_free_blocks
        if missing > 0 and self.sessions:
            self.sessions.reclaim(missing)
        return self.blocks.can_grow(req.request_id, num_positions)

    def positions_available(self, req: Request) -> int:
        return self.blocks.positions_available(req.request_id)

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
        out.scheduled = [item for item in out.scheduled if item.req is not req]
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = req.num_cached_tokens = 0  # recomputed in full, cached prefix included
        req.draft = None
        self.waiting.appendleft(req)
        out.preempted.append(req)
