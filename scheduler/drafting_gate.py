"""Which decoding requests propose a draft for the next step: one whose drafts the planner keeps declining rests.

Proposing costs host time every step (a context search, SPECTRA's dictionaries and indexes, an n-gram table lookup,
the planner's walk over the draft) that no forward pays back when the planner then verifies none of the draft. At
T = 1 on chat and math prompts, `spectra` and `ngram` proposed every step, had about 0.02 drafted tokens verified
per step, and ran 5-11 % slower than plain decoding for it (bench/results/spectra-20-sampled). So after
DECLINES_TO_REST non-empty drafts in a row of which nothing was verified, a request stops proposing for FIRST_REST
steps; the draft it proposes after the rest is a probe, and each probe declined doubles the next rest, up to
MAX_REST steps. A verified draft ends the resting for good (until DECLINES_TO_REST declines again). A probe's draft
is scored against the target's tokens like any other (scheduler/acceptance.py), so the estimates that decide its
fate keep learning while the request rests; what a rest can cost is a draft that would have paid in the MAX_REST
steps before the next probe. Drafting with a model is budgeted by the model's own measured seconds
(scheduler/model_drafts.py), and without the planner every draft is verified: neither rests.

A resting request still offers what its drafter finds at next to no cost (`Drafter.propose_resting`: SPECTRA's
guess from the model's own confident next tokens, one table lookup), priced by the planner like any draft; its
outcome neither ends the rest nor lengthens it, since the rest spares the full proposal's host time, which that
guess does not cost. At T = 1 on MT-Bench such guesses are there at ~9 % of steps and accepted ~40 % of the time,
about 4 times what their rows cost; left out of rests, which are ~80 % of the steps there, they were missed.
"""
from __future__ import annotations

from dataclasses import dataclass

DECLINES_TO_REST = 4  # declined drafts in a row before a request first rests
FIRST_REST = 2  # steps of the first rest
MAX_REST = 16  # the longest rest: a paying draft is missed for at most this many steps


@dataclass
class _Resting:
    declines: int = 0  # non-empty drafts declined in a row
    rest: int = 0  # steps of the latest rest (0: none since the last verified draft)
    left: int = 0  # steps of rest still to skip
    resting_now: bool = False  # the last step's `proposes` answered no


class DraftingGate:
    def __init__(self) -> None:
        self._requests: dict[str, _Resting] = {}  # request id -> its resting state (absent: never declined)

    def proposes(self, request_id: str) -> bool:
        """Whether the request proposes for the next step; asked once per decoding request per step (a step of rest
        is spent when it answers no)."""
        state = self._requests.get(request_id)
        if state is None:
            return True
        state.resting_now = bool(state.left)
        state.left -= state.resting_now
        return not state.resting_now

    def resting(self, request_id: str) -> bool:
        """Whether the request rests this step (asked after `proposes`)."""
        state = self._requests.get(request_id)
        return state is not None and state.resting_now

    def record(self, request_id: str, num_drafted: int, num_verified: int) -> None:
        """The planner verified NUM_VERIFIED of the NUM_DRAFTED tokens the request's draft offered this step (a draft
        offered while resting counts for nothing)."""
        if not num_drafted or self.resting(request_id):
            return
        if num_verified:
            self._requests.pop(request_id, None)
            return
        state = self._requests.setdefault(request_id, _Resting())
        state.declines += 1
        if state.declines >= DECLINES_TO_REST:
            state.rest = min(max(2 * state.rest, FIRST_REST), MAX_REST)
            state.left = state.rest

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    @property
    def num_resting(self) -> int:
        """Requests skipping their drafts now."""
        return sum(1 for state in self._requests.values() if state.left)
