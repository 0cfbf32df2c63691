"""How many look-ahead chains each decoding request's forward carries beside its verified draft.

A look-ahead chain (drafters/base.py's Draft.lookahead) is a few tokens that hang off the request's last token like
a draft path but are not verified: the logits after its last row go back to the drafter, which grows its guesses
from them (SPECTRA's candidate pool, drafters/spectra.py). On a GPU such rows are nearly free; on a CPU each costs
about what a verified token does, and it pays, if ever, in later steps' accepted tokens. So the planner weighs a
chain by the drafter's own running measure of what a row earns (Draft.lookahead_yield, tokens per row) and adds
chains, request by request, while the step's expected goodput rises:
    (E + y r) / T(n + r) > E / T(n)
E, n: the tokens the step is expected to yield and the tokens it carries so far; y r: what the chain's r rows earn;
T: the latency model; E counts the step's prefill chunks as the tokens their seconds would yield decoding
(scheduler/planner.py's prefill_worth). Zero chains is a valid outcome. Without the planner every chain is carried
while the token budget lasts (the paper's setting). A chain also needs KV slots for its rows (scratch: the next
update gives them back) and positions below the model's length.
"""
from __future__ import annotations

from collections.abc import Callable

from scheduler.records import ScheduledRequest, SchedulerOutput


class LookaheadPlan:
    """The step's look-ahead chains, chosen request by request after the verified drafts (see the module)."""

    def __init__(self, out: SchedulerOutput, budget: int, step_seconds: Callable[[int], float] | None,
                 prefill_worth: float = 0.0) -> None:
        self.num_tokens = out.num_scheduled_tokens
        self.expected = out.expected_tokens + prefill_worth
        self.budget = budget  # tokens the step may still carry
        self.step_seconds = step_seconds  # None: no planner

    def choose(self, item: ScheduledRequest, room: int) -> None:
        """Set the item's `lookahead` to the first chains of its draft worth carrying, within ROOM rows (its KV
        blocks and the model's length)."""
        draft = item.req.draft
        for chain in draft.lookahead if draft is not None else ():
            rows, earned = len(chain), draft.lookahead_yield * len(chain)
            if rows > min(self.budget, room) or not self._pays(earned, rows):
                break
            item.lookahead.append(tuple(chain))
            self.num_tokens, self.expected = self.num_tokens + rows, self.expected + earned
            self.budget, room = self.budget - rows, room - rows

    def _pays(self, earned: float, rows: int) -> bool:
        if self.step_seconds is None:
            return True
        after = (self.expected + earned) / self.step_seconds(self.num_tokens + rows)
        return after > self.expected / self.step_seconds(self.num_tokens)
