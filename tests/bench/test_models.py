"""bench models' rounds: which questions each round asks, and how a mode's rounds add up to its row."""
from bench.models import by_round, calibration_markdown, compared, rounds, totals, wave


def test_each_batch_size_runs_rounds_until_the_minimum_of_requests_and_at_least_two():
    # two rounds run the modes in both orders, so that no mode alone runs last in every round of its batch size
    assert [rounds(batch, 16) for batch in (1, 4, 5, 16, 64)] == [16, 4, 4, 2, 2]


def test_each_round_asks_the_next_questions_and_wraps_past_the_end():
    assert [wave(5, r, 2) for r in range(3)] == [[0, 1], [2, 3], [4, 0]]


def test_a_rows_figures_are_totals_over_its_rounds_not_means_of_their_ratios():
    keys = ("prompts", "outputs", "seconds", "drafts", "verified_draft_tokens", "accepted_draft_tokens")
    batches = [dict(zip(keys, ([[1]], [[7] * 30], 1.0, 10, 20, 15))),
               dict(zip(keys, ([[2]], [[8] * 10], 3.0, 0, 0, 0)))]
    total = totals(batches)
    assert total["prompts"] == [[1], [2]] and total["outputs"] == [[7] * 30, [8] * 10]
    assert total["tokens_per_s"] == 10.0  # 40 tokens in 4 s (the mean of 30 and 3.3 tok/s would be 16.7)
    assert total["mean_acceptance_length"] == 2.5 and total["rejected_share"] == 0.25
    assert total["round_tokens_per_s"] == [30.0, 10 / 3]


def test_each_rounds_ratio_is_taken_against_the_baseline_batch_of_the_same_round():
    mode = {"round_tokens_per_s": [30.0, 12.0, 9.0], "tokens_per_s": 17.0}
    none = {"round_tokens_per_s": [20.0, 12.0, 10.0], "tokens_per_s": 14.0}
    ratios = compared(mode, none, 0.7, None, "none")  # sampled: no output comparison
    assert ratios["speedup_vs_none_by_round"] == [1.5, 1.0, 0.9]
    assert by_round(ratios["speedup_vs_none_by_round"]) == "1.00 (0.90–1.50, 3 rounds)"
    assert by_round([0.97]) == "0.97 (1 round)" and by_round(None) == "–"


def test_the_calibration_table_names_the_heads_estimators_where_the_report_has_them():
    gain = {"entropy": 1.0, "given_S": 0.9, "given_A": 0.8, "given_S_and_A": 0.7, "information_gain": 0.3,
            "information_gain_share": 0.3}
    report = {"num_tokens": 10, "brier_companion": 0.1, "brier_statistical": 0.2, "information_gain": gain}
    calibration = {"command": "specserve calibrate sv", "greedy": report, "sampled": report}
    assert "draft head's probability" not in "\n".join(calibration_markdown(calibration))
    heads = {**report, "brier_statistical_by_depth": 0.15, "brier_draft_probability": 0.125}
    lines = calibration_markdown({**calibration, "greedy": heads, "sampled": heads})
    assert "| greedy | 0.1500 | 0.1250 |" in lines and "| sampled | 0.1500 | 0.1250 |" in lines
