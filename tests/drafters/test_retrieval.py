"""The retrieval index SPECTRA drafts from: the longest match of the context's end first, then the newest; documents
out oldest first within the byte bound, which holds for the memory the index really takes."""
import random
import tracemalloc

from drafters.retrieval import BYTES_PER_TOKEN, KEY_TOKENS, SuffixIndex


def test_the_longest_match_comes_first_then_the_newest():
    index = SuffixIndex(2**20)
    index.add([1, 2, 3, 4, 5, 6, 7])  # 1 2 3 4 -> 5 6 7: a 4-token match of the context below
    index.add([9, 1, 2, 3, 4, 8, 8])  # 9 1 2 3 4 -> 8 8: a 5-token match
    index.add([5, 2, 3, 4, 5, 6, 7, 7])  # 2 3 4 -> 5 6 7 (7), newest, a 3-token match: covered by the first's
    assert index.search([0, 9, 1, 2, 3, 4], max_guesses=5, max_tokens=3) == [([8, 8], 5), ([5, 6, 7], 4)]
    # 3-token matches all: newest first; the oldest document's continuation is the newest one's prefix, left out
    assert index.search([7, 2, 3, 4], max_guesses=5, max_tokens=10) == [([5, 6, 7, 7], 3), ([8, 8], 3)]
    assert index.search([0, 9, 1, 2, 3, 4], max_guesses=1, max_tokens=3) == [([8, 8], 5)]
    assert index.search([2, 3, 9], 5, 3) == [] and index.search([3, 4], 5, 3) == []


def test_documents_leave_oldest_first_and_too_short_or_too_large_ones_stay_out():
    index = SuffixIndex(BYTES_PER_TOKEN * 25)
    index.add([1, 2, 3])  # nothing after a key
    index.add(list(range(100, 126)))  # 26 tokens: over the bound on its own
    assert index.num_documents == 0
    index.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    index.add([11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    assert index.num_documents == 2 and index.search([1, 2, 3], 1, 2) == [([4, 5], 3)]
    index.add([21, 22, 23, 24, 25, 26, 27, 28, 29, 30])  # 30 tokens: the first goes
    assert index.num_documents == 2 and index.num_bytes == BYTES_PER_TOKEN * 20
    assert index.search([1, 2, 3], 1, 2) == [] and index.search([11, 12, 13], 1, 2) == [([14, 15], 3)]
    assert all(entry >> 32 != 0 for entries in index._positions.values() for entry in entries)


def test_a_fill_stays_within_the_bound_in_memory_really_taken():
    rng = random.Random(0)
    bound = 2**20
    tracemalloc.start()
    index = SuffixIndex(bound)
    peak_index_bytes = 0
    for _ in range(300):  # ~13 times the bound: every document evicts old ones; every key new
        index.add([rng.randrange(49152) for _ in range(rng.randrange(KEY_TOKENS + 1, 400))])
        peak_index_bytes = max(peak_index_bytes, index.num_bytes)
    taken, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak_index_bytes <= bound and index.num_documents > 5
    assert taken <= bound, f"the index takes {taken} bytes against its bound of {bound}"
