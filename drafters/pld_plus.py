"""PLD+ (Somasundaram et al. 2024, §4): copy after the earlier occurrence of the last token that the target's own
computations rank first.

Candidates are every earlier position j of the conversation (across turns through the session cache) whose token
equals the last token x_t.
- hidden (PLD+(h), eq. 3): rank by the cosine between the layer-l hidden states that produced the candidate's token
  (position j - 1) and the last token (position t - 1); states are kept unit-normalised, so it is a dot product.
- attention (PLD+(a), eq. 2): rank by the maximum, over the selected heads, of the attention of position t - 1 (the
  last position computed) at key j, the copy source of an induction head (our reading of the paper).
The draft is the K tokens after the best candidate (the paper's K = 70; the goodput planner decides how many are
verified); no candidate, no draft. What the ranking reads comes from the target's forward at no extra cost (the
forward contract's captures). Per request it keeps the hidden states of every position computed so far ([positions,
hidden] float16, ~1.1 kB a position for SmolLM2) and the last attention row; their bytes are counted (`state_bytes`)
so the engine can bound them, and the state carries over to a conversation's next turn.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

from drafters.base import CaptureSpec, Computed, Draft, DraftableRequest, DrafterBase, common_prefix_len

HIDDEN_DTYPE = torch.float16  # stored hidden states; the ranking multiplies them in float32
INITIAL_CAPACITY = 256  # positions of hidden states allocated at first; doubled as the conversation grows


@dataclass
class PldPlusState:
    """A conversation's tokens, where each token occurs, and what the target computed for each position."""

    token_ids: list[int] = field(default_factory=list)
    positions: dict[int, list[int]] = field(default_factory=dict)  # token -> its positions, ascending
    hidden: torch.Tensor | None = None  # [capacity, hidden] unit-normalised hidden states of positions 0..
    has_hidden: torch.Tensor | None = None  # [capacity] bool: position's hidden state is known
    last_attention: torch.Tensor | None = None  # [positions so far] max over heads of the last computed position's row

    @property
    def num_bytes(self) -> int:
        tensors = (self.hidden, self.has_hidden, self.last_attention)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def append(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            self.positions.setdefault(token, []).append(len(self.token_ids))
            self.token_ids.append(token)

    def keep_prefix(self, length: int) -> None:
        """Forget everything from position LENGTH on (an edited turn parts from the history there)."""
        if length >= len(self.token_ids):
            return
        kept = self.token_ids[:length]
        self.token_ids, self.positions = [], {}
        self.append(kept)
        if self.has_hidden is not None:
            self.has_hidden[length:] = False
        self.last_attention = None

    def store_hidden(self, start: int, states: torch.Tensor) -> None:
        """Unit-normalised STATES [n, hidden] of positions START .. START + n - 1."""
        end = start + states.shape[0]
        self._reserve(end, states.shape[1])
        self.hidden[start:end] = torch.nn.functional.normalize(states.float(), dim=-1).to(HIDDEN_DTYPE)
        self.has_hidden[start:end] = True

    def _reserve(self, num_positions: int, width: int) -> None:
        capacity = 0 if self.hidden is None else self.hidden.shape[0]
        if num_positions <= capacity:
            return
        new_capacity = max(INITIAL_CAPACITY, capacity * 2, num_positions)
        hidden = torch.zeros(new_capacity, width, dtype=HIDDEN_DTYPE)
        known = torch.zeros(new_capacity, dtype=torch.bool)
        if self.hidden is not None:
            hidden[:capacity], known[:capacity] = self.hidden, self.has_hidden
        self.hidden, self.has_hidden = hidden, known


def rank_by_hidden(state: PldPlusState, candidates: list[int]) -> int | None:
    """The candidate j whose position j - 1 has the hidden state closest to that of position t - 1 (t: the last)."""
    query = len(state.token_ids) - 2
    usable = [j for j in candidates if j >= 1 and _known(state, j - 1)]
    if not usable or not _known(state, query):
        return None
    scores = state.hidden[[j - 1 for j in usable]].float() @ state.hidden[query].float()  # cosines
    return usable[int(torch.argmax(scores))]


def rank_by_attention(state: PldPlusState, candidates: list[int]) -> int | None:
    """The candidate the selected heads' attention from the last computed position weighs most."""
    row = state.last_attention
    usable = [j for j in candidates if row is not None and j < row.shape[0]]
    if not usable:
        return None
    return usable[int(torch.argmax(row[usable]))]


def _known(state: PldPlusState, position: int) -> bool:
    return state.has_hidden is not None and position < state.has_hidden.shape[0] and bool(state.has_hidden[position])


RANKINGS = {"hidden": rank_by_hidden, "attention": rank_by_attention}


class PldPlusDrafter(DrafterBase):
    name = "pld-plus"

    def __init__(self, ranking: str, max_tokens: int, layer: int | None = None,
                 heads: tuple[tuple[int, int], ...] = ()) -> None:
        if ranking not in RANKINGS:
            raise ValueError(f"PLD+ ranking must be one of {tuple(RANKINGS)}, got {ranking!r}")
        self.ranking = ranking
        self.max_tokens = max_tokens  # K
        hidden = ranking == "hidden"
        self.captures = CaptureSpec(hidden_layers=(layer,)) if hidden else CaptureSpec(attention_heads=heads)
        self._states: dict[str, PldPlusState] = {}  # request id -> its state
        self._chosen: dict[str, tuple[int, int]] = {}  # request id -> (copied-after token, first match's) of its draft
        self.stats: Counter[str] = Counter()  # how often the ranked candidate differed from the first match, and won

    def begin(self, req: DraftableRequest, state: PldPlusState | None = None) -> None:
        if state is None:
            state = PldPlusState()
        state.keep_prefix(common_prefix_len(state.token_ids, req.all_token_ids))
        state.append(req.all_token_ids[len(state.token_ids):])
        self._states[req.request_id] = state

    def observe(self, req: DraftableRequest, computed: Computed) -> None:
        state = self._states[req.request_id]
        if computed.hidden_states is not None:
            state.store_hidden(computed.start, computed.hidden_states)
        if computed.attention is not None:
            state.last_attention = computed.attention.float().amax(dim=0)  # [positions] max over the heads

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        self._score_last_choice(req.request_id, new_token_ids)
        self._states[req.request_id].append(new_token_ids)

    def propose(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        return [self._propose_one(req.request_id) for req in reqs]

    def _propose_one(self, request_id: str) -> Draft:
        state = self._states[request_id]
        last = len(state.token_ids) - 1
        candidates = [j for j in state.positions.get(state.token_ids[-1], ()) if j < last]
        best = RANKINGS[self.ranking](state, candidates) if candidates else None
        if best is None:
            return Draft([], self.name)
        self._chosen[request_id] = (best, candidates[0])
        return Draft(state.token_ids[best + 1:best + 1 + self.max_tokens], self.name)

    def _score_last_choice(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        """Count whether the ranked candidate and the first match would each have drafted the target's next token."""
        chosen = self._chosen.pop(request_id, None)
        if chosen is None or not new_token_ids:
            return
        tokens, target = self._states[request_id].token_ids, new_token_ids[0]
        best, first = chosen
        self.stats["drafts"] += 1
        if best != first:
            self.stats["differs_from_first_match"] += 1
            self.stats["ranked_right"] += tokens[best + 1] == target
            self.stats["first_match_right"] += tokens[first + 1] == target

    def preempt(self, req: DraftableRequest) -> None:
        """Its positions will be computed again and observed again; what is known stays right meanwhile."""

    def finish(self, req: DraftableRequest) -> PldPlusState | None:
        self._chosen.pop(req.request_id, None)
        return self._states.pop(req.request_id, None)

    def state_bytes(self) -> int:
        """Memory of the live requests' states."""
        return sum(state.num_bytes for state in self._states.values())
