"""A request's corpus across turns: its index catches up with the corpus when read."""
from drafters.base import TOKEN_BYTES
from drafters.corpus import SessionCorpus
from drafters.spectra import NgramDictionaries


class CountingIndex(NgramDictionaries):
    """SPECTRA's dictionaries, counting the calls that index."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def extend(self, token_ids) -> None:
        self.calls += 1
        super().extend(token_ids)


def test_appended_tokens_are_indexed_when_the_index_is_read_as_if_each_had_been_at_once():
    tokens = [5, 7, 9, 5, 7, 11, 5, 7, 9, 13, 2, 5]
    lazy, eager = SessionCorpus(tokens[:3], CountingIndex), NgramDictionaries()
    eager.extend(tokens[:3])
    for end in range(4, len(tokens) + 1):  # a token a step, as a request rests from drafting
        lazy.append(tokens[end - 1:end])
        eager.extend(tokens[:end])
    assert lazy.num_bytes == TOKEN_BYTES * len(tokens)  # nothing indexed until the index is read
    assert lazy.index.calls == 1  # then everything in one call
    assert lazy.index.forward == eager.forward and lazy.index.backward == eager.backward
    assert lazy.index.calls == 1  # read again with nothing new: no call
    assert lazy.num_bytes == TOKEN_BYTES * len(tokens) + eager.num_bytes


def test_a_next_turn_that_parts_from_the_last_reindexes_from_the_divergence():
    corpus = SessionCorpus([1, 2, 3, 4, 5, 6], NgramDictionaries)
    corpus.index  # read once: indexed
    corpus.follow([1, 2, 3, 9, 9])  # an edited turn: the old tokens from 4 on become the earlier version
    assert corpus.corpus == [4, 5, 6, 1, 2, 3, 9, 9]
    fresh = NgramDictionaries()
    fresh.extend(corpus.corpus)
    assert corpus.index.forward == fresh.forward and corpus.index.backward == fresh.backward
