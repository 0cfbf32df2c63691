"""The Drafter contract shared by every drafter."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


class DraftableRequest(Protocol):
    """What a drafter may read of a request: its id and every token so far (prompt + output)."""

    request_id: str
    all_token_ids: list[int]


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]  # [num_draft_tokens] proposed continuation; empty = nothing worth verifying
    source: str  # the drafter that proposed it
    probs: list[float] | None = None  # [num_draft_tokens] draft-model probabilities; None = point mass
    tree_parents: list[int] | None = field(default=None)  # several candidates: parent index per token

    def __len__(self) -> int:
        return len(self.token_ids)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Drafter(Protocol):
    """Per request: `begin`, then `extend` and `propose` each step, then `finish`.

    A session cache (engine/sessions.py) carries a drafter's state from one turn of a
    conversation to the next: what `finish` returns for a turn is what `begin` gets
    for the conversation's next turn. A state is the drafter's own, opaque to everyone
    else; the next turn's prompt may extend the history it was built on or part from
    it (an edited turn), and `begin` must be right either way. A drafter keeps no
    reference to a state after `finish` returns it.
    """

    name: str

    def begin(self, req: DraftableRequest, state: object | None = None) -> None:
        """Index a new request: its prompt, on top of the state its session's last turn left (None: afresh)."""

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        """Take the tokens just appended to `req.all_token_ids` into the drafter's state."""

    def propose(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        """One draft per request, in order."""

    def finish(self, req: DraftableRequest) -> object | None:
        """Forget a request that finished or was aborted; returns its state for the session's next turn."""
