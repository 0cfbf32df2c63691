"""Drafting with an EAGLE-3 head (`--drafter draft` when `--draft-model` is a head; engine/model/eagle3.py).

A head drafts as a draft model does (drafters/model_draft.py: the scheduler's budget per request, one packed forward
per drafted position, q kept for the verifier) but each token it reads comes with a state: for the request's real
tokens the target's own hidden states at the three layers the head names, captured in the target's forward (`observe`)
and fused by the head only when it reads them (a head the planner keeps off costs no fusing); for a drafted token the
head's own output at the position before. Its entry for the token at position p reads the state at p - 1, so each
round first computes the real tokens the head has not yet read with the target's states (the tokens accepted last
step, or a whole prompt), whose last output drafts the first token.

Drafted tokens' entries read the head's states, not the target's: when the target accepts them, the next round
computes them again with the target's (as vLLM does), so the head's KV only ever holds real tokens read with the
target's states. A state the head needs and does not have (a session resumed past where its states were kept, a prompt
prefix served from the KV cache) reads zeros, which can cost acceptance, never exactness.

A greedy request's draft is a tree (EAGLE-2's top-k expansion, one level deep at each position): beside each drafted
token the head's next SIBLINGS most likely tokens hang off the same parent as leaves. They come from the logits the
chain's forward computed anyway, so they cost the head nothing. Each node carries the head's own probability of its
token as its acceptance estimate (EAGLE-2's observation, which holds for the shipped head: on MT-Bench, first drafted
tokens the head gave 0.1-0.2 were accepted 14 % of the time, 0.5-0.6 51 %, 0.9-1.0 93 %; the planner's calibration
corrects the rest), so the planner verifies the tokens the head is sure of, and chains go on only as long as their
paths' probabilities are worth another head forward (the scheduler's `continuing`). A sampled request drafts a chain as
deep as the planner says: its tokens are draws from q, and the verifier's min(1, p/q) rule is a chain's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from drafters.base import CaptureSpec, Computed, Draft, DraftableRequest, common_prefix_len
from drafters.model_draft import ModelDrafter

# the head's next most likely tokens offered beside each token a greedy request drafts (EAGLE-2 expands its top 8-10
# at the GPU's almost free rows; on a CPU a verified row costs ~8 % of a step, so only the likeliest few can pay)
SIBLINGS = 2


@dataclass
class HeadKV:
    """What the head holds of a request's real tokens. The target's states arrive every step, read or not (a head the
    planner keeps off reads none for a while): they are kept as the chunks they came in, joined only when read, so a
    step costs the same whatever the unread history's length."""

    num_valid: int = 0  # positions whose head KV holds the request's real tokens read with the target's states
    token_ids: list[int] = field(default_factory=list)  # those tokens, when a turn ends (what a next turn shares)
    states_start: int = 0  # position of the first kept state
    chunks: list[torch.Tensor] = field(default_factory=list)  # [n, 3 * hidden] target states from states_start on
    num_states: int = 0  # rows in chunks

    @property
    def num_bytes(self) -> int:
        """Bytes of the kept states (asked twice a step: the chunks share one row width and type)."""
        return self.num_states * self.chunks[0].shape[-1] * self.chunks[0].element_size() if self.chunks else 0

    def add_states(self, start: int, states: torch.Tensor) -> None:
        """The target's states of positions START.. (a step's or a chunk's, in order)."""
        if start != self.states_start + self.num_states:
            self.states_start, self.chunks, self.num_states = start, [], 0
        self.chunks.append(states)
        self.num_states += len(states)

    def read_by(self, start: int, end: int, width: int) -> torch.Tensor:
        """[end - start, width] the states the entries of positions START..END-1 read: each the state at p - 1,
        zeros where none is kept."""
        out = torch.zeros(end - start, width)
        first = max(start - 1, self.states_start)  # positions of the states read, first..last-1
        last = min(end - 1, self.states_start + self.num_states)
        if first < last:
            states = self._joined()
            out[first + 1 - start:last + 1 - start] = states[first - self.states_start:last - self.states_start]
        return out

    def keep_from(self, position: int) -> None:
        """Forget the states of positions before POSITION: read already."""
        if not self.chunks or position <= self.states_start:
            return
        kept = self._joined()[position - self.states_start:]
        self.chunks, self.num_states, self.states_start = ([kept] if len(kept) else []), len(kept), position

    def _joined(self) -> torch.Tensor:
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks)]
        return self.chunks[0]


class HeadDrafter(ModelDrafter):
    """A draft model's drafter whose model is a head: the target's states in, the head's own states carried from one
    drafted position to the next."""

    def __init__(self, forward, max_tokens: int, companion=None, tables: dict[bool, object] | None = None) -> None:
        super().__init__(forward, max_tokens, companion, tables)
        self.captures: CaptureSpec = forward.captures
        self._kv: dict[str, HeadKV] = {}
        self._siblings: dict[str, list[list[int]]] = {}  # per request drafting this round, per drafted token
        # per request drafting this round, per drafted token: the estimate of its acceptance given its parent's (a
        # greedy request's head probability of it, then of its siblings; with a companion, SV's estimate of it alone)
        self._confidence: dict[str, list[list[float]]] = {}

    def begin(self, req: DraftableRequest, state: object | None = None) -> None:
        """A session's next turn keeps what the head computed of the prefix it shares with the history and whose KV
        the cache kept."""
        super().begin(req)
        kv = state if isinstance(state, HeadKV) else HeadKV()
        shared = common_prefix_len(kv.token_ids, req.all_token_ids)
        kv.num_valid = min(kv.num_valid, shared, req.num_computed_tokens)
        self._kv[req.request_id] = kv

    def observe(self, req: DraftableRequest, computed: Computed) -> None:
        if computed.hidden_states is not None and len(computed.token_ids):
            self._kv[req.request_id].add_states(computed.start, computed.hidden_states)

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        """Drafted entries are never kept (the next round reads the accepted tokens with the target's states); the
        companion's table learns each outcome."""
        state = self._states[req.request_id]
        self._learn(req, state, new_token_ids)
        state.fed, state.drafted, state.scores = [], [], []

    def preempt(self, req: DraftableRequest) -> None:
        self._kv[req.request_id] = HeadKV()

    def finish(self, req: DraftableRequest) -> HeadKV | None:
        self._states.pop(req.request_id, None)
        kv = self._kv.pop(req.request_id, None)
        if kv is not None:
            kv.token_ids = list(req.all_token_ids[:kv.num_valid])
        return kv

    def state_bytes(self) -> int:
        return super().state_bytes() + sum(kv.num_bytes for kv in self._kv.values())

    def _draft(
        self, drafting: list[DraftableRequest], budgets: dict[str, int],
    ) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
        """The first forward reads each request's unread real tokens with the target's states (fused in one call for
        the whole round); each next one a drafted token with the head's output before it. A companion head runs the
        same chains beside it, reading the same target states and its own outputs, and scores each drafted token."""
        drafted: dict[str, list[int]] = {req.request_id: [] for req in drafting}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req in drafting}
        self._siblings, self._confidence = {}, {}
        for req in drafting:
            self._states[req.request_id].scores = []
        chains, states = zip(*map(self._catch_up, drafting)) if drafting else ((), ())
        features = self._fused(self.forward, states)
        scoring = self.companion.forward if self.companion and chains else None
        companion_features = self._fused(scoring, states) if scoring else ()
        while chains:
            logits, outputs = self.forward.run(list(chains), list(features))
            tokens = [self._take(req, row[0], drafted, probs) for req, row in zip(drafting, logits)]
            if scoring:
                scores, companion_outputs = scoring.run(list(chains), list(companion_features))
                for req, token, row in zip(drafting, tokens, scores):
                    self._score(req, probs[req.request_id][-1], row[0], token)
            budgeted = [i for i, req in enumerate(drafting) if len(drafted[req.request_id]) < budgets[req.request_id]]
            going = self.forward.continuing([self._path_probability(drafting[i]) for i in budgeted])
            chosen = [i for i, goes in zip(budgeted, going) if goes]
            chains = [(drafting[i].request_id, [tokens[i]], len(drafting[i].all_token_ids) + len(
                drafted[drafting[i].request_id]) - 1) for i in chosen]
            features = [outputs[i][None] for i in chosen]
            companion_features = [companion_outputs[i][None] for i in chosen] if scoring else ()
            drafting = [drafting[i] for i in chosen]
        return drafted, probs

    @staticmethod
    def _fused(forward, states: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """Per chain, what its tokens read: the target's STATES through FORWARD's head, fused in one call."""
        return forward.fuse(torch.cat(states)).split([len(s) for s in states]) if states else ()

    def _score(self, req: DraftableRequest, q: torch.Tensor, companion_logits: torch.Tensor, token: int) -> None:
        """SV's observation of a drafted TOKEN (q: its draft distribution over the target's vocabulary) against the
        companion's distribution c, and its acceptance estimate: the companion table's where one is calibrated
        (`specserve calibrate sv`), else A itself. c is 0 outside the companion's draft vocabulary, so both sums run
        over that vocabulary alone: S = sum min(q, c) there, A = min(1, c(x) / q(x))."""
        companion = self.companion.forward
        c = companion.probs(companion_logits, req.sampling)  # processed over its draft vocabulary: -inf elsewhere
        s = float(torch.minimum(q[companion.target_ids], c).sum())
        draft_id = int(companion.draft_ids[token])
        a = min(1.0, float(c[draft_id]) / max(float(q[token]), 1e-12)) if draft_id >= 0 else 0.0
        self._states[req.request_id].scores.append((s, a))
        table = self.tables.get(req.sampling.greedy)
        self._confidence.setdefault(req.request_id, []).append([table.estimate(s, a) if table is not None else a])

    def _companion_estimates(self, reqs: list[DraftableRequest]) -> dict[str, list[float]]:
        """Per request, the estimates its drafted tokens were scored with as they were drafted (with a companion)."""
        if self.companion is None:
            return {}
        return {req.request_id: [level[0] for level in self._confidence[req.request_id]] for req in reqs}

    def _path_probability(self, req: DraftableRequest) -> float:
        """The estimated probability that the request's whole chain so far is accepted: the head's probability of it
        (1 for a sampled request without a companion: its tokens are draws, their acceptance is not their
        probability), or SV's estimates with a companion."""
        return math.prod(level[0] for level in self._confidence.get(req.request_id, ()))

    def _draw(self, req: DraftableRequest, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """As a draft model draws from LOGITS [draft vocab], widened to the target's vocabulary only where q is
        asked: a greedy request without a companion takes the draft argmax's target id, and keeps the next SIBLINGS
        as its siblings."""
        if req.sampling.greedy and not self.companion:
            top = torch.softmax(logits.float(), dim=-1).topk(min(1 + SIBLINGS, len(logits)))
            token, *siblings = self.forward.target_ids[top.indices].tolist()
            self._siblings.setdefault(req.request_id, []).append(siblings)
            self._confidence.setdefault(req.request_id, []).append(top.values.tolist())
            return token, None
        return super()._draw(req, self.forward.target_logits(logits))

    def _as_draft(self, req: DraftableRequest, token_ids: list[int], acceptance: list[float] | None) -> Draft:
        """The chain TOKEN_IDS with each token's siblings beside it (parents first) and the head's probability of each
        node, where the request kept them (a greedy request)."""
        siblings = self._siblings.get(req.request_id)
        if not siblings or acceptance is not None:
            return super()._as_draft(req, token_ids, acceptance)
        tree, parents, parent = [], [], -1
        for token, others in zip(token_ids, siblings):
            tree += [token, *others]
            parents += [parent] * (1 + len(others))
            parent = len(tree) - 1 - len(others)
        confidence = [q for level in self._confidence[req.request_id] for q in level]
        return Draft(tree, self.name, parents, acceptance=confidence)

    def _unread(self, req: DraftableRequest) -> int:
        return len(req.all_token_ids) - self._kv[req.request_id].num_valid

    def _catch_up(self, req: DraftableRequest) -> tuple[tuple[str, list[int], int], torch.Tensor]:
        """The chain of the request's tokens the head has not read, and the target's states they read (unfused)."""
        kv, end = self._kv[req.request_id], len(req.all_token_ids)
        start = min(kv.num_valid, end - 1)
        chain = (req.request_id, list(req.all_token_ids[start:end]), start)
        states = kv.read_by(start, end, self.forward.state_size)
        kv.num_valid = end
        kv.keep_from(end - 1)
        return chain, states

