"""The drafter as the engine runs it: what it is shown after each step, what it proposes, and its state between
the turns of a session.

The scheduler decides which session a turn resumes and when a session is evicted
(scheduler/sessions.py); the drafter's state for each cached session is kept here,
by the session's key, because drafter states may hold tensors (hidden states, say)
that the scheduler never sees.
"""
from __future__ import annotations

from typing import Sequence

from drafters.base import CaptureSpec, Draft, Drafter
from engine.batching import computed_for_drafter
from engine.forward import ForwardBatch, ForwardOutput
from scheduler.records import ScheduledRequest, Verification
from scheduler.request import Request


class Speculation:
    def __init__(self, drafter: Drafter | None) -> None:
        self.drafter = drafter
        self.session_states: dict[str, object] = {}  # session key -> the drafter's state after its last turn

    @property
    def captures(self) -> CaptureSpec:
        return self.drafter.captures if self.drafter else CaptureSpec()

    def begin(self, req: Request, session_key: str | None) -> None:
        """A new request; SESSION_KEY names the session whose state it resumes (one turn at a time takes it)."""
        if self.drafter:
            state = self.session_states.pop(session_key, None) if session_key else None
            self.drafter.begin(req, state)

    def observe(
        self, scheduled: list[ScheduledRequest], batch: ForwardBatch, output: ForwardOutput | None,
        results: list[Verification],
    ) -> None:
        """Show the drafter every token the step committed, prefill chunks included, with its captures."""
        if not self.drafter or output is None:
            return
        for i, (item, forward, result) in enumerate(zip(scheduled, batch.items, results)):
            self.drafter.observe(item.req, computed_for_drafter(item, forward, result, output, i))

    def extend(self, req: Request, new_token_ids: Sequence[int]) -> None:
        if self.drafter:
            self.drafter.extend(req, new_token_ids)

    def propose(self, reqs: list[Request]) -> list[Draft]:
        return self.drafter.propose(reqs) if self.drafter and reqs else []

    def preempt(self, reqs: list[Request]) -> None:
        if self.drafter:
            for req in reqs:
                self.drafter.preempt(req)

    def finish(self, req: Request, session_key: str | None) -> None:
        """The request is gone; its drafter state is kept for the session's next turn, if it updated one."""
        state = self.drafter.finish(req) if self.drafter else None
        if session_key is not None and state is not None:
            self.session_states[session_key] = state

    def forget_sessions(self, keys: list[str]) -> None:
        for key in keys:
            self.session_states.pop(key, None)
