"""Drafting with a model (`--drafter draft`), and copy first, model second (`--drafter copyspec+draft`).

The draft model runs autoregressively, all drafting requests batched in one packed
forward per drafted position, for as many tokens as the scheduler allowed each request
this step (`DraftForward.budget`: it reserved their KV blocks, and the goodput planner
may allow none). Each drafted token is the draft model's argmax for a greedy request;
for a sampled request it is drawn from the draft distribution q — the draft model's
logits after the request's temperature, top-k and top-p, the processing the target's
p gets — and q is kept here, for the verifier's min(1, p/q) test and residual
(engine/verifier.py). q never leaves the engine process and never reaches the scheduler.

The draft model's KV: an early exit of the target shares the target's pool, so every
position the target computed is computed for it. A separate draft model keeps its own
KV at the same slots; this drafter counts, per request, the positions whose draft KV
holds the request's real tokens, and each round starts by computing the ones after
(the prompt at the first draft — lazily, rather than alongside each prefill chunk — and
afterwards the bonus token, and the last drafted token when all were accepted). Drafted
tokens the target accepts keep the KV the draft model computed for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from drafters.base import Draft, DraftableRequest, DrafterBase, common_prefix_len

DRAFT_SEED_OFFSET = 0x5EED  # a seeded request draws its drafts from a generator of its own, seeded apart from the target's


@dataclass
class DraftState:
    """A request's draft-model bookkeeping."""

    num_valid: int = 0  # positions whose draft-model KV holds the request's tokens (separate draft models only)
    fed: list[int] | None = None  # drafted tokens fed to the draft model at the last proposal (their KV is written)
    generator: torch.Generator | None = None  # for sampled drafts of a seeded request
    probs: torch.Tensor | None = None  # [num drafted, vocab] q of the last proposal's tokens; None when greedy


class ModelDrafter(DrafterBase):
    name = "draft"

    def __init__(self, forward, max_tokens: int) -> None:
        self.forward = forward  # engine/draft_model.py's DraftForward
        self.max_tokens = max_tokens
        self._states: dict[str, DraftState] = {}

    def begin(self, req: DraftableRequest, state: object | None = None) -> None:
        seed = getattr(req.sampling, "seed", None)
        generator = torch.Generator().manual_seed(seed + DRAFT_SEED_OFFSET) if seed is not None else None
        self._states[req.request_id] = DraftState(generator=generator)

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        """The accepted drafted tokens that were fed to the draft model keep their KV."""
        state = self._states[req.request_id]
        if state.fed:
            state.num_valid += common_prefix_len(new_token_ids, state.fed)
        state.fed = None

    def preempt(self, req: DraftableRequest) -> None:
        self._states[req.request_id].num_valid = 0

    def finish(self, req: DraftableRequest) -> None:
        self._states.pop(req.request_id, None)

    def distributions(self, req: DraftableRequest) -> torch.Tensor | None:
        state = self._states.get(req.request_id)
        return state.probs if state else None

    def propose(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        budgets = {req.request_id: min(self.forward.budget(req.request_id), self.max_tokens) for req in reqs}
        drafting = [req for req in reqs if budgets[req.request_id] > 0]
        drafted: dict[str, list[int]] = {req.request_id: [] for req in drafting}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req in drafting}
        chains = [self._catch_up(req) for req in drafting]
        while chains:
            logits = self.forward(chains)
            chains = []
            for req, row in zip(drafting, logits):
                token, q = self._draw(req, row)
                drafted[req.request_id].append(token)
                if q is not None:
                    probs[req.request_id].append(q)
                position = len(req.all_token_ids) + len(drafted[req.request_id]) - 1
                if len(drafted[req.request_id]) < budgets[req.request_id]:
                    chains.append((req.request_id, [token], position))
            drafting = [req for req in drafting if len(drafted[req.request_id]) < budgets[req.request_id]]
        return [self._draft(req, drafted.get(req.request_id, []), probs.get(req.request_id)) for req in reqs]

    def _catch_up(self, req: DraftableRequest) -> tuple[str, list[int], int]:
        """The first chain of a request's round: its tokens whose draft KV is not computed yet, ending at its last."""
        state = self._states[req.request_id]
        start = req.num_computed_tokens if self.forward.shares_target_kv else state.num_valid
        state.num_valid = len(req.all_token_ids)
        return req.request_id, req.all_token_ids[start:], start

    def _draw(self, req: DraftableRequest, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The drafted token, and q when the request samples."""
        params = req.sampling
        if params.greedy:
            return int(logits.argmax()), None
        q = self.forward.probs(logits, params)
        return int(torch.multinomial(q, 1, generator=self._states[req.request_id].generator)), q

    def _draft(self, req: DraftableRequest, token_ids: list[int], probs: list[torch.Tensor] | None) -> Draft:
        state = self._states[req.request_id]
        state.fed = token_ids[:-1]  # the last drafted token is never fed
        state.probs = torch.stack(probs) if probs else None
        return Draft(token_ids, self.name)

    def state_bytes(self) -> int:
        return sum(s.probs.numel() * s.probs.element_size() for s in self._states.values() if s.probs is not None)


class CopyThenDraft(DrafterBase):
    """CopySpec's draft when its index matches the last γ tokens, the draft model's otherwise (CopySpec §3.3)."""

    name = "copyspec+draft"

    def __init__(self, copy: DrafterBase, model: ModelDrafter) -> None:
        self.copy = copy
        self.model = model
        self._parts = (copy, model)

    def begin(self, req: DraftableRequest, state: object | None = None) -> None:
        self.copy.begin(req, state)
        self.model.begin(req)

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        for part in self._parts:
            part.extend(req, new_token_ids)

    def preempt(self, req: DraftableRequest) -> None:
        for part in self._parts:
            part.preempt(req)

    def finish(self, req: DraftableRequest) -> object | None:
        self.model.finish(req)
        return self.copy.finish(req)

    def distributions(self, req: DraftableRequest) -> torch.Tensor | None:
        return self.model.distributions(req) if req.draft is not None and req.draft.source == self.model.name else None

    def propose(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        drafts = self.copy.propose(reqs)
        uncovered = [i for i, draft in enumerate(drafts) if not len(draft)]
        for i, draft in zip(uncovered, self.model.propose([reqs[i] for i in uncovered])):
            drafts[i] = draft
        return drafts

    def state_bytes(self) -> int:
        return self.copy.state_bytes() + self.model.state_bytes()
