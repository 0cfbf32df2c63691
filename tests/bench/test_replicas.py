"""bench replicas' bookkeeping: its conversations, the replicas' counts between two reads, hit rates, turn figures."""
from bench.replicas import THIRD_TURN, TurnRecord, conversations_for, counts_between, hit_rates, turn_summary


def test_conversations_alternate_named_and_unnamed_each_with_three_turns_and_its_own_tag():
    questions = [{"turns": ["q1 a", "q1 b"]}, {"turns": ["q2 a", "q2 b"]}]
    conversations = conversations_for(questions, 4, "run")
    assert [c.kind for c in conversations] == ["explicit", "implicit", "explicit", "implicit"]
    assert conversations[2].turns == ["q1 a", "q1 b", THIRD_TURN] and conversations[2].session_id == "run-2"
    assert len({c.tag for c in conversations}) == 4


def test_hit_rates_sum_the_replicas_differences_by_kind():
    before = {"hits": {"explicit": 1, "implicit": 0}, "misses": {"explicit": 0, "implicit": 2}, "requests": 5}
    after = {"hits": {"explicit": 4, "implicit": 2}, "misses": {"explicit": 1, "implicit": 2}, "requests": 11}
    other = {"hits": {"explicit": 2, "implicit": 0}, "misses": {"explicit": 0, "implicit": 0}, "requests": 3}
    deltas = [counts_between(before, after), other]
    assert deltas[0]["requests"] == 6
    assert hit_rates(deltas) == {"explicit": {"hits": 5, "misses": 1, "hit_rate": 0.833},
                                 "implicit": {"hits": 2, "misses": 0, "hit_rate": 1.0}}


def test_turn_figures_keep_failed_attempts_and_unanswered_turns_apart():
    records = [TurnRecord("a", "explicit", 2, 0.0, ttft_s=0.5), TurnRecord("b", "explicit", 2, 0.0, ttft_s=1.5),
               TurnRecord("c", "explicit", 2, 0.0, ttft_s=0.7, errors=[(3.0, "RemoteProtocolError")]),
               TurnRecord("d", "explicit", 2, 0.0, errors=[(3.0, "x"), (3.5, "x"), (4.0, "x")])]
    figures = turn_summary(records)["explicit turn 2"]
    assert figures == {"turns": 4, "ttft_p50_s": 0.7, "ttft_p90_s": 0.7, "failed_attempts": 4, "unanswered": 1}
