"""bench routing-sim's stand-ins: turn counts, a replica's warm sessions, and the figures it reports."""
import random
import statistics
from collections import Counter

from bench.routing_sim import NAMED, UNNAMED, Replica, imbalance, later_turns, turns_of


def test_turn_counts_are_at_least_one_with_the_asked_mean():
    rng = random.Random(0)
    counts = [turns_of(rng, 3.0) for _ in range(20_000)]
    assert min(counts) == 1 and abs(statistics.mean(counts) - 3.0) < 0.1
    assert turns_of(rng, 1.0) == 1


def test_a_replica_counts_later_turns_it_holds_as_hits_and_forgets_the_least_recently_used():
    replica, counts = Replica("http://r", warm_sessions=2), Counter()
    for conversation, turn in [("a", 1), ("b", 1), ("a", 2), ("c", 1), ("b", 2), ("a", 3)]:
        replica.serve_turn(conversation, NAMED if conversation == "a" else UNNAMED, turn, counts, "p")
    # a's second turn is a hit; c pushes b out, b's return pushes a out: both later turns miss
    assert counts == {("p", NAMED, "hit"): 1, ("p", NAMED, "miss"): 1, ("p", UNNAMED, "miss"): 1}
    assert list(replica.sessions) == ["b", "a"] and replica.served == 6
    assert later_turns(counts, "p", NAMED) == {"later_turns": 2, "hit_rate": 0.5}
    assert later_turns(counts, "p", UNNAMED) == {"later_turns": 1, "hit_rate": 0.0}
    assert later_turns(counts, "other phase", NAMED) == {"later_turns": 0, "hit_rate": None}


def test_imbalance_is_the_busiest_replica_over_the_mean():
    assert imbalance([10, 10, 40]) == 2.0 and imbalance([0, 0]) == 0.0
