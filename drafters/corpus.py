"""A request's copy source across the turns of its conversation, with an incremental index over it.

Shared by the drafters that draw on the conversation itself (CopySpec's γ-gram index,
the context n-grams). corpus = earlier version + the request's tokens. A next turn
whose prompt extends the last request's tokens just extends the corpus (the index
grows by the new tokens only). A turn that parts from them (an earlier turn was
edited) makes the last request's tokens from the point of divergence on (the old
version of that turn, the old answer after it) the earlier version, and its own
prompt the rest: the old answer stays there to copy from, and the corpus never
passes twice the context.

The index catches up with the corpus when it is read, not at every append: a request
resting from drafting (scheduler/drafting_gate.py) appends its tokens each step and
indexes them all when it next drafts, in one pass while the host's caches are warm
(between forwards each append's indexing cost about three times as long as in a loop).
"""
from __future__ import annotations

from typing import Callable, Generic, Protocol, Sequence, TypeVar

from drafters.base import TOKEN_BYTES, Draft, DraftableRequest, DrafterBase, common_prefix_len


class CorpusIndex(Protocol):
    def extend(self, token_ids: Sequence[int]) -> None:
        """Index what was appended to TOKEN_IDS since the last call."""

    @property
    def num_bytes(self) -> int:
        """Host memory the index holds (an estimate per indexed token, measured)."""


IndexT = TypeVar("IndexT", bound=CorpusIndex)


class SessionCorpus(Generic[IndexT]):
    def __init__(self, token_ids: Sequence[int], new_index: Callable[[], IndexT]) -> None:
        self.new_index = new_index
        self._start((), token_ids)

    def _start(self, earlier: Sequence[int], token_ids: Sequence[int]) -> None:
        self.num_earlier = len(earlier)
        # [corpus length] the earlier version, then the request's tokens
        self.corpus: list[int] = [*earlier, *token_ids]
        self._index: IndexT = self.new_index()
        self._num_indexed = 0  # corpus tokens the index has been shown

    @property
    def index(self) -> IndexT:
        """The index over the whole corpus (what was appended since it was last read is indexed now)."""
        if self._num_indexed < len(self.corpus):
            self._index.extend(self.corpus)
            self._num_indexed = len(self.corpus)
        return self._index

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

    @property
    def num_bytes(self) -> int:
        """Host memory of the corpus and of its index as far as it has been read."""
        return TOKEN_BYTES * len(self.corpus) + self._index.num_bytes


class CorpusDrafter(DrafterBase, Generic[IndexT]):
    """A drafter that draws on the conversation itself: per request a SessionCorpus with the drafter's own index,
    begun afresh or from the state its session's last turn left. Subclasses say how a corpus becomes a draft."""

    def __init__(self, new_index: Callable[[], IndexT]) -> None:
        self.new_index = new_index
        self._corpora: dict[str, SessionCorpus[IndexT]] = {}  # request id -> its corpus

    def begin(self, req: DraftableRequest, state: SessionCorpus[IndexT] | None = None) -> None:
        if state is not None:
            state.follow(req.all_token_ids)
        else:
            state = SessionCorpus(req.all_token_ids, self.new_index)
        self._corpora[req.request_id] = state

    def extend(self, req: DraftableRequest, new_token_ids: Sequence[int]) -> None:
        self._corpora[req.request_id].append(new_token_ids)

    def propose(self, reqs: Sequence[DraftableRequest]) -> list[Draft]:
        return [self.draft(req.request_id, self._corpora[req.request_id]) for req in reqs]

    def draft(self, request_id: str, corpus: SessionCorpus[IndexT]) -> Draft:
        """The draft for a request whose corpus (ending with its last token) is CORPUS."""
        raise NotImplementedError

    def finish(self, req: DraftableRequest) -> SessionCorpus[IndexT] | None:
        return self._corpora.pop(req.request_id, None)

    def state_bytes(self) -> int:
        return sum(corpus.num_bytes for corpus in self._corpora.values())
