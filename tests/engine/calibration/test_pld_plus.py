"""PLD+ calibration on synthetic traces: the induction head is found, the layer whose states tell the sources apart
is chosen, and a cheaper head set wins when it scores almost as well."""
import torch

from engine.calibration.pld_plus import HEAD_TOLERANCE, Traced, calibrate, cheapest_head_count, head_hit_rates

# Prompt: 5 occurs twice, followed by 10 11 12 and by 20 21 22. The answer repeats the second copy: 2 5 20 21 22.
PROMPT = [1, 5, 10, 11, 12, 2, 5, 20, 21, 22, 3]
ANSWER = [2, 5, 20, 21, 22]
LAYERS, HEADS = 2, 3
INDUCTION = (1, 2)  # the head whose attention from the position before a token peaks at that token's source


def synthetic_trace() -> Traced:
    tokens = PROMPT + ANSWER
    n = len(tokens)
    attention = torch.full((LAYERS, HEADS, n, n), 0.01).tril()
    for t in range(len(PROMPT), n):
        sources = [r for r in range(len(PROMPT)) if tokens[r] == tokens[t]]
        if sources:
            attention[INDUCTION[0], INDUCTION[1], t - 1, sources[-1]] = 0.9
    states = torch.randn(n, 8, generator=torch.Generator().manual_seed(1))
    telling = states.clone()
    states[len(PROMPT)] = states[0]  # layers 1 and 3: the answer's 2 "looks like" the 1 before the first 5
    telling[len(PROMPT)] = telling[5]  # layer 2: it looks like the 2 before the second 5
    hidden = [torch.nn.functional.normalize(s, dim=-1) for s in (states, states, telling, states)]
    return Traced(tokens, len(PROMPT), hidden, attention)


def test_the_induction_head_has_the_highest_hit_rate():
    rates = head_hit_rates([synthetic_trace()])
    assert rates.shape == (LAYERS, HEADS)
    assert divmod(int(rates.argmax()), HEADS) == INDUCTION and rates[INDUCTION] == 1.0


def test_calibration_keeps_the_layer_and_heads_that_find_the_right_source():
    calibration = calibrate([synthetic_trace()])
    assert calibration.layer == 2
    assert calibration.ranked_heads[0] == list(INDUCTION)
    assert calibration.scores["hidden"] > calibration.scores["first_match"]
    assert calibration.scores["attention"] > calibration.scores["first_match"]


def test_the_fewest_heads_within_the_tolerance_of_the_best_are_chosen():
    best = 5.0
    assert cheapest_head_count({5: 4.0, 20: best * (1 - HEAD_TOLERANCE / 2), 0: best}) == 20
    assert cheapest_head_count({5: 4.0, 20: best * (1 - 2 * HEAD_TOLERANCE), 0: best}) == 0
    assert cheapest_head_count({5: best, 20: best, 0: best}) == 5
