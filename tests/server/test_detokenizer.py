"""Incremental detokenization and stop strings against the embedded model's real tokenizer."""
from __future__ import annotations

import pytest

from server.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopChecker

TEXTS = [
    "héllo wörld 你好 🙂",
    "Hello, world!\n\n    indented  double  spaces\ttab",
    "👨‍👩‍👧 family, ﬁ ligature, Ελληνικά, русский, עברית, 日本語のテキスト",
    " leading space and trailing space ",
]
IM_START, IM_END = 1, 2  # ChatML special tokens of SmolLM2


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def detokenize(tokenizer, token_ids: list[int], chunk_size: int) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add(token_ids[i : i + chunk_size]) for i in range(0, len(token_ids), chunk_size)]
    return deltas + [detokenizer.flush()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7])
def test_round_trip_is_exact(tokenizer, text, chunk_size):
    deltas = detokenize(tokenizer, encode(tokenizer, text), chunk_size)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_multibyte_characters_are_held_back_until_complete(tokenizer):
    token_ids = encode(tokenizer, "你好")
    assert len(token_ids) > 2  # byte-level BPE splits these characters across tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([t]) for t in token_ids]
    assert "" in deltas[:-1]
    assert "".join(deltas) == "你好"


def test_special_tokens_are_skipped(tokenizer):
    text = "héllo wörld"
    token_ids = [IM_START] + encode(tokenizer, text) + [IM_END]
    assert "".join(detokenize(tokenizer, token_ids, 1)) == text


def test_flush_releases_an_incomplete_character(tokenizer):
    first_byte_token = encode(tokenizer, "你")[0]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add([first_byte_token]) == ""
    assert detokenizer.flush() == tokenizer.decode([first_byte_token])
    assert detokenizer.flush() == ""


@pytest.mark.parametrize(
    "stop, deltas, expected_emitted, expected_stop_step",
    [
        # no stop strings: everything passes through
        ([], ["a", "b"], ["a", "b"], None),
        # a stop string inside one delta: truncated before it
        (["END"], ["abc END tail"], ["abc "], 0),
        # split across deltas: the partial match is held back, then dropped
        (["END"], ["abc E", "N", "D tail"], ["abc ", "", ""], 2),
        # a held-back partial match that turns out not to be a stop string is released
        (["END"], ["abc E", "Nx"], ["abc ", "ENx"], None),
        # overlapping prefix: "EEND" holds one E, releases it, then stops
        (["END"], ["E", "EN", "D"], ["", "E", ""], 2),
        # stop at the very start
        (["\n"], ["\nrest"], [""], 0),
        # the earliest of several stop strings wins
        (["world", "lo w"], ["hello world"], ["hel"], 0),
        # multi-character emoji stop string split across deltas
        (["🙂!"], ["ok 🙂", "!"], ["ok ", ""], 1),
    ],
)
def test_stop_checker(stop, deltas, expected_emitted, expected_stop_step):
    checker = StopChecker(stop)
    emitted, stop_step = [], None
    for step, delta in enumerate(deltas):
        text, hit = checker.push(delta)
        emitted.append(text)
        if hit and stop_step is None:
            stop_step = step
    assert emitted == expected_emitted
    assert stop_step == expected_stop_step


def test_stop_checker_flush_releases_the_held_tail_only_without_a_stop():
    checker = StopChecker(["END"])
    assert checker.push("abc EN") == ("abc ", False)
    assert checker.flush() == "EN"
    stopped = StopChecker(["END"])
    assert stopped.push("x END") == ("x ", True)
    assert stopped.flush() == ""
    assert stopped.push("more") == ("", True)


@pytest.mark.parametrize("chunk_size", [1, 2])
def test_stop_string_across_tokens_with_detokenizer(tokenizer, chunk_size):
    text = "The answer is 42.\nSTOP here, 你好"
    token_ids = encode(tokenizer, text)
    detokenizer, checker = IncrementalDetokenizer(tokenizer), StopChecker(["\nSTOP", "unused stop"])
    emitted, hit = "", False
    for i in range(0, len(token_ids), chunk_size):
        delta, hit = checker.push(detokenizer.add(token_ids[i : i + chunk_size]))
        emitted += delta
        assert "\n" not in emitted  # never leaks the start of the stop string
        if hit:
            break
    assert hit
    assert emitted == "The answer is 42."
