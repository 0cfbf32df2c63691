"""bench routing-sim's stand-ins: tokens with the prefix property, turn counts, and a replica's warm sessions."""
import random
import statistics
from collections import Counter

from bench.routing_sim import Replica, token_ids, turns_of


def test_a_later_turns_tokens_start_with_the_earlier_turns_tokens():
    first = [{"role": "system", "content": "conversation 7"}, {"role": "user", "content": "why is the sky blue"}]
    later = first + [{"role": "assistant", "content": "light scatters"}, {"role": "user", "content": "and red"}]
    assert token_ids(later)[:len(token_ids(first))] == token_ids(first)
    other = [{"role": "system", "content": "conversation 8"}, first[1]]
    assert token_ids(other)[:2] == token_ids(first)[:2] and token_ids(other) != token_ids(first)


def test_turn_counts_are_at_least_one_with_the_asked_mean():
    rng = random.Random(0)
    counts = [turns_of(rng, 3.0) for _ in range(20_000)]
    assert min(counts) == 1 and abs(statistics.mean(counts) - 3.0) < 0.1
    assert turns_of(rng, 1.0) == 1


def test_a_replica_counts_later_turns_it_holds_as_hits_and_forgets_the_least_recently_used():
    replica, counts = Replica("http://r", warm_sessions=2), Counter()
    for conversation, turn in [("a", 1), ("b", 1), ("a", 2), ("c", 1), ("b", 2), ("a", 3)]:
        replica.serve_turn(conversation, turn, counts, "p")
    # a's second turn is a hit; c pushes b out, b's return pushes a out: both later turns miss
    assert counts == {("p", "hit"): 1, ("p", "miss"): 2}
    assert list(replica.sessions) == ["b", "a"] and replica.served == 6
