"""The drafter as the engine runs it: what it is shown after each step, what it proposes, and its state between
the turns of a session.

The scheduler decides which session a turn resumes and when a session is evicted
(scheduler/sessions.py); the drafter's state for each cached session is kept here,
by the session's key, because drafter states may hold tensors (hidden states, say)
that the scheduler never sees. Their memory is counted in bytes (a state's
`num_bytes`, read once when it is cached: a cached state does not change until a
turn takes it back; and the drafter's `state_bytes()` for its live requests); the
engine bounds the cached sessions' host memory, these states included, by evicting
whole sessions (engine/engine.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from drafters.base import CaptureSpec, Draft, Drafter
from engine.batching import computed_for_drafter
from engine.model.forward import ForwardBatch, ForwardOutput
from scheduler.records import ScheduledRequest, Verification
from scheduler.request import Request

# the live requests' drafter states are re-read for the step stats every this many steps (and after any request began
# or finished): they grow a few bytes a token, and reading them right after a forward, the host's caches cold, costs
# ~10 µs a step, 0.2 % of a single-stream decode step here
LIVE_BYTES_STEPS = 16


class Speculation:
    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.session_states: OrderedDict[str, object] = OrderedDict()  # session key -> state, least recently used first
        self._session_bytes: dict[str, int] = {}  # session key -> its state's num_bytes when it was cached
        self._session_bytes_total = 0
        self._live_bytes: int | None = None  # the live states' bytes as last read (None: to be read again)
        self._reports = 0  # reported_state_bytes calls

    @property
    def captures(self) -> CaptureSpec:
        return self.drafter.captures

    def begin(self, req: Request, session_key: str | None) -> bool:
        """A new request; SESSION_KEY names the session whose state it resumes (one turn at a time takes it).

        Returns whether a state was resumed."""
        state = self._take_session_state(session_key) if session_key else None
        self.drafter.begin(req, state)
        self._live_bytes = None
        return state is not None

    def observe(
        self, scheduled: list[ScheduledRequest], batch: ForwardBatch, output: ForwardOutput | None,
        results: list[Verification],
    ) -> None:
        """Show the drafter every token the step committed, prefill chunks included, with its captures."""
        if output is None:
            return
        for i, (item, forward, result) in enumerate(zip(scheduled, batch.items, results)):
            self.drafter.observe(item.req, computed_for_drafter(item, forward, result, output, i))

    def extend(self, req: Request, new_token_ids: Sequence[int]) -> None:
        self.drafter.extend(req, new_token_ids)

    def propose(self, reqs: list[Request]) -> list[Draft]:
        return self.drafter.propose(reqs) if reqs else []

    def propose_resting(self, reqs: list[Request]) -> list[Draft]:
        return self.drafter.propose_resting(reqs) if reqs else []

    def distributions(self, req: Request):
        """The distributions the request's draft was sampled from (a draft model's q), or None for point masses."""
        return self.drafter.distributions(req)

    def preempt(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.drafter.preempt(req)
        self._live_bytes = None

    def finish(self, req: Request, session_key: str | None) -> None:
        """The request is gone; its drafter state is kept for the session's next turn, if it updated one."""
        state = self.drafter.finish(req)
        self._live_bytes = None
        if session_key is not None and state is not None:
            self._take_session_state(session_key)
            self.session_states[session_key] = state
            self._session_bytes[session_key] = state.num_bytes
            self._session_bytes_total += state.num_bytes

    def forget_sessions(self, keys: list[str]) -> None:
        for key in keys:
            self._take_session_state(key)

    def _take_session_state(self, key: str) -> object | None:
        self._session_bytes_total -= self._session_bytes.pop(key, 0)
        return self.session_states.pop(key, None)

    @property
    def needs_every_position(self) -> bool:
        """Whether the drafter reads what the target computed at every prompt position, a cached prefix included."""
        return self.captures.needs_every_position

    def state_bytes(self) -> int:
        """Host memory of drafter states: the live requests' and the cached sessions'."""
        return self.drafter.state_bytes() + self.session_state_bytes()

    def reported_state_bytes(self) -> int:
        """`state_bytes` as each step's stats report it: the live states re-read every LIVE_BYTES_STEPS steps and
        after any request began or finished, the cached sessions' exact."""
        self._reports += 1
        if self._live_bytes is None or self._reports % LIVE_BYTES_STEPS == 0:
            self._live_bytes = self.drafter.state_bytes()
        return self._live_bytes + self.session_state_bytes()

    def session_state_bytes(self) -> int:
        return self._session_bytes_total
