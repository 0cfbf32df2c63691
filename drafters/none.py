"""Plain decoding as a drafter: it proposes nothing, so every step verifies only the target's own next token."""
from __future__ import annotations

from typing import Sequence

from drafters.base import Draft, DraftableRequest, DrafterBase


class NoDrafter(DrafterBase):
    """`--drafter none`: an empty draft for every request, and no state between turns."""

    name = "none"

    def begin(self, req: DraftableRequest, state: object | None = None) -> None:
        pass

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        pass

    def propose(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        return [Draft([], self.name) for _ in reqs]

    def finish(self, req: DraftableRequest) -> object | None:
        return None
