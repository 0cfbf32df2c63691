"""CopySpec (Dumitru et al. 2025, §3.1-3.2): copy what followed an earlier occurrence of the last γ tokens.

A hash map holds the first position of every γ-token subsequence of the request's
context. Each accepted token adds one γ-gram (O(γ)), and each proposal is one
lookup of the last γ tokens (O(γ)), independent of the context length.

With session caches the index outlives a turn (§3.3: the whole chat history): the
next turn of the conversation resumes it with the tokens as generated, and adds only
its new tokens.
"""
from __future__ import annotations

from typing import Sequence

from drafters.base import Draft, DraftableRequest, common_prefix_len


class CopyIndex:
    """First occurrence of every γ-gram of a growing token list."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        self.first_start: dict[tuple[int, ...], int] = {}  # γ-gram -> start position of its first occurrence
        self.num_indexed = 0  # tokens of the list already covered

    def extend(self, token_ids: Sequence[int]) -> None:
        """Index the γ-grams that end at the tokens appended since the last call."""
        gamma = self.gamma
        for end in range(max(self.num_indexed + 1, gamma), len(token_ids) + 1):
            self.first_start.setdefault(tuple(token_ids[end - gamma:end]), end - gamma)
        self.num_indexed = len(token_ids)

    def continuation(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The tokens after the first earlier, non-overlapping occurrence of the last γ tokens."""
        gamma, length = self.gamma, len(token_ids)
        if length < 2 * gamma:
            return []
        start = self.first_start.get(tuple(token_ids[length - gamma:]))
        if start is None or start + gamma > length - gamma:
            return []
        copy_from = start + gamma
        return list(token_ids[copy_from:min(copy_from + max_tokens, length)])


class CopyState:
    """A request's copy source and its index: the request's own tokens, after what an edit replaced.

    corpus = earlier version + the request's tokens. A next turn whose prompt extends
    the last request's tokens just extends the corpus (the index grows by the new
    tokens only). A turn that parts from them (an earlier turn was edited) makes the
    last request's tokens from the point of divergence on (the old version of that
    turn, the old answer after it) the earlier version, and its own prompt the rest:
    the old answer stays there to copy from, and the corpus never passes twice the
    context.
    """

    def __init__(self, token_ids: Sequence[int], gamma: int) -> None:
        self.gamma = gamma
        self._start((), token_ids)

    def _start(self, earlier: Sequence[int], token_ids: Sequence[int]) -> None:
        self.num_earlier = len(earlier)
        self.corpus = [*earlier, *token_ids]  # [corpus length] the earlier version, then the request's tokens
        self.index = CopyIndex(self.gamma)
        self.index.extend(self.corpus)

    def follow(self, prompt_ids: Sequence[int]) -> None:
        """Make the corpus end with a new turn's prompt."""
        own = self.corpus[self.num_earlier:]
        num_common = common_prefix_len(own, prompt_ids)
        if num_common == len(own):
            self.append(prompt_ids[num_common:])
        else:
            self._start(own[num_common:], prompt_ids)

    def append(self, token_ids: Sequence[int]) -> None:
        self.corpus += token_ids
        self.index.extend(self.corpus)


class CopySpecDrafter:
    name = "copyspec"

    def __init__(self, gamma: int = 3, max_tokens: int = 10) -> None:
        self.gamma = gamma
        self.max_tokens = max_tokens
        self._states: dict[str, CopyState] = {}  # request id -> its copy source

    def begin(self, req: DraftableRequest, state: CopyState | None = None) -> None:
        if state is not None:
            state.follow(req.all_token_ids)
        else:
            state = CopyState(req.all_token_ids, self.gamma)
        self._states[req.request_id] = state

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        self._states[req.request_id].append(new_token_ids)

    def propose(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        return [self._propose_one(req) for req in reqs]

    def _propose_one(self, req: DraftableRequest) -> Draft:
        state = self._states[req.request_id]
        return Draft(token_ids=state.index.continuation(state.corpus, self.max_tokens), source=self.name)

    def finish(self, req: DraftableRequest) -> CopyState | None:
        return self._states.pop(req.request_id, None)
