"""Drafting with a model (`--drafter draft`), and copy first, model second (`--drafter copyspec+draft`).

The draft model runs autoregressively, all drafting requests batched in one packed forward per drafted position, for
as many tokens as the scheduler allows each request this step (`DraftForward.reserve`: the scheduler reserves their KV
blocks, and its goodput planner may allow none). A greedy request drafts the draft model's argmax; a sampled one draws
from q, the draft model's logits after the request's temperature, top-k and top-p (the processing the target's p gets).
q stays here, in the engine process, for the verifier's min(1, p/q) test and residual (engine/verifier.py) and the
companion's scores. With a companion model (SV §4, engine/companion.py), one packed forward of it over every drafted
token gives each token's (S, A), and its profiled table the acceptance estimate the planner weighs the token by.

The draft model's KV: an early exit of the target shares the target's pool. A separate draft model keeps its own KV
at the same slots; this drafter counts, per request, the positions whose draft KV holds the request's real tokens, and
each round first computes the ones after (the prompt at the first draft, lazily, then the bonus token, and the last
drafted token when all are accepted). Drafted tokens the target accepts keep the KV the draft model computed for them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from drafters.base import Computed, Draft, DraftableRequest, DrafterBase, common_prefix_len

# a seeded request draws its drafts from a generator of its own, seeded apart from the target's
DRAFT_SEED_OFFSET = 0x5EED


def overlap_and_acceptance(q: torch.Tensor, c: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SV's observations of drafted TOKENS [n] with draft distributions q and companion distributions c [n, vocab]:
    S = sum_v min(q(v), c(v)), the overlap, and A = min(1, c(x) / q(x)), x's acceptance were c the target."""
    overlap = torch.minimum(q, c).sum(dim=-1)
    rows = torch.arange(len(tokens))
    acceptance = (c[rows, tokens] / q[rows, tokens].clamp_min(1e-12)).clamp(max=1.0)
    return overlap, acceptance


class ModelKV:
    """Per request, the positions whose KV a model (draft or companion) holds for the request's real tokens: all the
    target computed, for an early exit; else what the model computed and the target then accepted."""

    def __init__(self, forward) -> None:
        self.forward = forward  # engine/model/draft_model.py's DraftForward
        self.num_valid: dict[str, int] = {}

    def computed(self, req: DraftableRequest) -> int:
        """How many of the request's first tokens the model has computed."""
        return req.num_computed_tokens if self.forward.shares_target_kv else self.num_valid.get(req.request_id, 0)

    def catch_up(self, req: DraftableRequest, then: Sequence[int] = ()) -> tuple[str, list[int], int]:
        """A chain of the request's tokens the model has not computed, ending at its last token, then THEN."""
        start = self.computed(req)
        self.num_valid[req.request_id] = len(req.all_token_ids)
        return req.request_id, [*req.all_token_ids[start:], *then], start

    def accept(self, req: DraftableRequest, num_tokens: int) -> None:
        """NUM_TOKENS more of the tokens fed after the request's last one were accepted: their KV stays right."""
        self.num_valid[req.request_id] = self.num_valid.get(req.request_id, 0) + num_tokens

    def forget(self, req: DraftableRequest) -> None:
        self.num_valid.pop(req.request_id, None)


@dataclass
class DraftState:
    """A request's draft-model bookkeeping."""

    fed: list[int] = field(default_factory=list)  # drafted tokens fed to the models at the last proposal
    drafted: list[int] = field(default_factory=list)  # the last proposal's tokens
    scores: list[tuple[float, float]] = field(default_factory=list)  # [drafted] the companion's (S, A) of each
    generator: torch.Generator | None = None  # for sampled drafts of a seeded request
    probs: torch.Tensor | None = None  # [num drafted, vocab] q of the last proposal's tokens (processed as p is)


class ModelDrafter(DrafterBase):
    name = "draft"

    def __init__(self, forward, max_tokens: int, companion=None, tables: dict[bool, object] | None = None) -> None:
        self.forward = forward  # engine/model/draft_model.py's DraftForward
        self.max_tokens = max_tokens
        self.draft_kv = ModelKV(forward)
        self.companion = ModelKV(companion) if companion is not None else None  # SV (engine/companion.py)
        self.tables = tables or {}  # greedy? -> engine/companion.py's SvTable, for the companion's estimates
        self._states: dict[str, DraftState] = {}

    def begin(self, req: DraftableRequest, state: object | None = None) -> None:
        seed = getattr(req.sampling, "seed", None)
        generator = torch.Generator().manual_seed(seed + DRAFT_SEED_OFFSET) if seed is not None else None
        self._states[req.request_id] = DraftState(generator=generator)

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        """The accepted drafted tokens that were fed keep their KV; the companion's table learns each outcome."""
        state = self._states[req.request_id]
        num_fed_accepted = common_prefix_len(new_token_ids, state.fed)
        for model_kv in filter(None, (self.draft_kv, self.companion)):
            model_kv.accept(req, num_fed_accepted)
        self._learn(req, state, new_token_ids)
        state.fed, state.drafted, state.scores = [], [], []

    def _learn(self, req: DraftableRequest, state: DraftState, new_token_ids: Sequence[int]) -> None:
        """Each drafted token whose parent was accepted, scored against the target's token at its depth."""
        table = self.tables.get(req.sampling.greedy)
        if table is None:
            return
        for (s, a), drafted, target in zip(state.scores, state.drafted, new_token_ids):
            table.observe(s, a, float(drafted == target))
            if drafted != target:
                return

    def preempt(self, req: DraftableRequest) -> None:
        for model_kv in filter(None, (self.draft_kv, self.companion)):
            model_kv.forget(req)

    def finish(self, req: DraftableRequest) -> None:
        self._states.pop(req.request_id, None)
        self.preempt(req)

    def distributions(self, req: DraftableRequest) -> torch.Tensor | None:
        state = self._states.get(req.request_id)
        return state.probs if state else None

    def propose(
        self, reqs: Sequence[DraftableRequest], beside: Sequence[tuple[DraftableRequest, Draft]] = ()
    ) -> list[Draft]:
        """Drafts for REQS; BESIDE: the rest of the batch's decoding requests with their drafts, which the scheduler
        weighs the draft's cost against."""
        allowed = self.forward.reserve(list(reqs), list(beside), {req.request_id: self._unread(req) for req in reqs})
        budgets = {req.request_id: min(allowed.get(req.request_id, 0), self.max_tokens) for req in reqs}
        drafted, probs = self._draft([req for req in reqs if budgets[req.request_id] > 0], budgets)
        for req in reqs:
            self._keep(req, drafted.get(req.request_id, []), probs.get(req.request_id))
        acceptance = self._companion_estimates([req for req in reqs if drafted.get(req.request_id)])
        return [self._as_draft(r, drafted.get(r.request_id, []), acceptance.get(r.request_id)) for r in reqs]

    def _unread(self, req: DraftableRequest) -> int:
        """The request's tokens the draft model has not computed: its next round's first forward reads them."""
        return len(req.all_token_ids) - self.draft_kv.computed(req)

    def _as_draft(self, req: DraftableRequest, token_ids: list[int], acceptance: list[float] | None) -> Draft:
        """The draft of the request's drafted chain TOKEN_IDS."""
        return Draft(token_ids, self.name, acceptance=acceptance)

    def _draft(
        self, drafting: list[DraftableRequest], budgets: dict[str, int],
    ) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
        """Per request, its drafted tokens (as many as its budget) and their q where kept: one packed forward of
        every drafting request per drafted position."""
        drafted: dict[str, list[int]] = {req.request_id: [] for req in drafting}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req in drafting}
        chains = [self.draft_kv.catch_up(req) for req in drafting]
        while chains:
            logits = torch.cat(self.forward(chains))
            chains = []
            for req, row in zip(drafting, logits):
                token = self._take(req, row, drafted, probs)
                position = len(req.all_token_ids) + len(drafted[req.request_id]) - 1
                if len(drafted[req.request_id]) < budgets[req.request_id]:
                    chains.append((req.request_id, [token], position))
            drafting = [req for req in drafting if len(drafted[req.request_id]) < budgets[req.request_id]]
        return drafted, probs

    def _take(
        self, req: DraftableRequest, logits: torch.Tensor, drafted: dict[str, list[int]],
        probs: dict[str, list[torch.Tensor]],
    ) -> int:
        """Draw the request's next drafted token from LOGITS [vocab] into DRAFTED (its q into PROBS); returns it."""
        token, q = self._draw(req, logits)
        drafted[req.request_id].append(token)
        if q is not None:
            probs[req.request_id].append(q)
        return token

    def _draw(self, req: DraftableRequest, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The drafted token (the argmax for a greedy request, a draw from q otherwise), and q — for a greedy
        request only when a companion scores it (the verifier's argmax walk needs none)."""
        params = req.sampling
        if params.greedy:
            return int(logits.argmax()), self.forward.probs(logits, params) if self.companion else None
        q = self.forward.probs(logits, params)
        return int(torch.multinomial(q, 1, generator=self._states[req.request_id].generator)), q

    def _keep(self, req: DraftableRequest, token_ids: list[int], probs: list[torch.Tensor] | None) -> None:
        state = self._states[req.request_id]
        state.drafted, state.fed = token_ids, token_ids[:-1]  # the last drafted token is never fed
        state.probs = torch.stack(probs) if probs else None

    def _companion_estimates(self, reqs: list[DraftableRequest]) -> dict[str, list[float]]:
        """Per request, the companion table's acceptance estimate of each drafted token (SV §4), after one packed
        forward of the companion over every drafted token; empty without a companion."""
        if self.companion is None or not reqs:
            return {}
        states = [self._states[req.request_id] for req in reqs]
        chains = [self.companion.catch_up(req, state.fed) for req, state in zip(reqs, states)]
        rows = self.companion.forward(chains, [len(state.drafted) for state in states])
        estimates = {}
        for req, state, logits in zip(reqs, states, rows):
            c = torch.stack([self.companion.forward.probs(row, req.sampling) for row in logits])
            s, a = overlap_and_acceptance(state.probs, c, torch.tensor(state.drafted))
            state.scores = list(zip(s.tolist(), a.tolist()))
            table = self.tables.get(req.sampling.greedy)
            if table is not None:
                estimates[req.request_id] = [table.estimate(sv, av) for sv, av in state.scores]
        return estimates

    def state_bytes(self) -> int:
        return sum(s.probs.numel() * s.probs.element_size() for s in self._states.values() if s.probs is not None)


class CopyThenDraft(DrafterBase):
    """CopySpec's draft when its index matches the last γ tokens, the draft model's otherwise (CopySpec §3.3)."""

    name = "copyspec+draft"

    def __init__(self, copy: DrafterBase, model: ModelDrafter) -> None:
        self.copy = copy
        self.model = model
        self._parts = (copy, model)
        self.captures = model.captures  # a head's target states (CopySpec needs none)

    def begin(self, req: DraftableRequest, state: object | None = None) -> None:
        self.copy.begin(req, state)
        self.model.begin(req)

    def observe(self, req: DraftableRequest, computed: Computed) -> None:
        self.model.observe(req, computed)

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
        copied = [(req, draft) for req, draft in zip(reqs, drafts) if len(draft)]
        for i, draft in zip(uncovered, self.model.propose([reqs[i] for i in uncovered], copied)):
            drafts[i] = draft
        return drafts

    def state_bytes(self) -> int:
        return self.copy.state_bytes() + self.model.state_bytes()
