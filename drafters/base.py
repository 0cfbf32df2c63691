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


class Drafter(Protocol):
    name: str

    def begin(self, req: DraftableRequest) -> None:
        """Index a new request: its prompt and any session history it carries."""

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        """Take the tokens just appended to `req.all_token_ids` into the drafter's state."""

    def propose(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        """One draft per request, in order."""

    def finish(self, req: DraftableRequest) -> None:
        """Forget a request that finished or was aborted."""
