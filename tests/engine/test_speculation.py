"""Speculation's bookkeeping of cached session states: their bytes, counted once when cached, always add up to the
states it holds, through caching, resuming, replacing and forgetting."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from drafters.none import NoDrafter
from engine.speculation import Speculation


@dataclass
class State:
    num_bytes: int


class StateDrafter(NoDrafter):
    """Returns the state it was given for each request, so a test decides the bytes."""

    def __init__(self) -> None:
        self.states: dict[str, State] = {}
        self.begun: dict[str, object] = {}

    def begin(self, req, state) -> None:
        self.begun[req.request_id] = state

    def finish(self, req) -> State | None:
        return self.states.pop(req.request_id, None)


def finish(speculation: Speculation, request_id: str, session_key: str, num_bytes: int) -> None:
    speculation.drafter.states[request_id] = State(num_bytes)
    speculation.finish(SimpleNamespace(request_id=request_id), session_key)


def held_bytes(speculation: Speculation) -> int:
    return sum(state.num_bytes for state in speculation.session_states.values())


def test_cached_state_bytes_add_up_through_caching_resuming_replacing_and_forgetting():
    speculation = Speculation(StateDrafter())
    finish(speculation, "a", "s1", 100)
    finish(speculation, "b", "s2", 30)
    assert speculation.session_state_bytes() == held_bytes(speculation) == 130
    finish(speculation, "c", "s1", 7)  # a later turn of s1 replaces its state
    assert speculation.session_state_bytes() == held_bytes(speculation) == 37
    assert speculation.begin(SimpleNamespace(request_id="d"), "s2")  # resumed: no longer cached
    assert speculation.drafter.begun["d"] == State(30) and speculation.session_state_bytes() == 7
    speculation.forget_sessions(["s1", "unknown"])
    assert speculation.session_state_bytes() == held_bytes(speculation) == 0 and not speculation.session_states
    speculation.finish(SimpleNamespace(request_id="e"), "s3")  # no state: nothing cached
    assert speculation.session_state_bytes() == 0 and "s3" not in speculation.session_states


class GrowingDrafter(StateDrafter):
    """Its live states hold a byte per token extended, as a drafter's dictionaries grow."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0

    def extend(self, req, new_token_ids) -> None:
        self.live += len(new_token_ids)

    def state_bytes(self) -> int:
        return self.live


def test_reported_state_bytes_reread_live_states_every_few_steps_and_when_requests_come_and_go():
    from engine.speculation import LIVE_BYTES_STEPS

    speculation = Speculation(GrowingDrafter())
    req = SimpleNamespace(request_id="a")
    speculation.begin(req, None)
    assert speculation.reported_state_bytes() == 0
    reported = []
    for step in range(1, 2 * LIVE_BYTES_STEPS + 1):
        speculation.extend(req, [1])
        reported.append(speculation.reported_state_bytes())
        assert step - LIVE_BYTES_STEPS < reported[-1] <= step == speculation.state_bytes()  # stale by < 16 steps
    assert len(set(reported)) == 3  # read twice in 32 steps, not every step
    speculation.extend(req, [1, 2])
    finish(speculation, "a", "s1", 5)  # a request finished: its state is read at once
    speculation.drafter.live = 0
    assert speculation.reported_state_bytes() == 5 == speculation.state_bytes()
