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
