"""Benchmark data: every set in one question shape, a clear stop when files are missing, and the tests' own guard."""
import gzip
import json
import subprocess
import sys

import pytest

from bench.data import DATASETS, MissingDataError, first_per_category, load_questions
from tests.conftest import OUTSIDE_DATA, REPO, TEST_DATA_DIR


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_every_set_loads_as_questions_with_turns(name):
    questions = load_questions(name, TEST_DATA_DIR)
    assert questions and all({"question_id", "category", "turns"} <= set(q) for q in questions)
    assert all(isinstance(turn, str) and turn for q in questions for turn in q["turns"])


def test_humaneval_uses_the_evalplus_instruct_prompt_and_gsm8k_the_bare_question():
    with gzip.open(TEST_DATA_DIR / "HumanEval.jsonl.gz", "rt") as f:
        first_task = json.loads(f.readline())
    turn = load_questions("humaneval", TEST_DATA_DIR)[0]["turns"][0]
    assert turn.startswith("Please provide a self-contained Python script") and first_task["prompt"].strip() in turn
    with open(TEST_DATA_DIR / "gsm8k_test.jsonl") as f:
        assert load_questions("gsm8k", TEST_DATA_DIR)[0]["turns"] == [json.loads(f.readline())["question"]]


def test_a_missing_file_names_itself_and_its_source(tmp_path):
    with pytest.raises(MissingDataError) as error:
        load_questions("gsm8k", tmp_path)
    assert "gsm8k_test.jsonl" in str(error.value) and "openai/grade-school-math" in str(error.value)
    assert str(tmp_path) in str(error.value) and "--data-dir" in str(error.value)


def test_bench_without_its_data_stops_at_once_with_the_message_and_no_traceback(tmp_path):
    """The real command, in a process of its own, pointed at an empty folder: exit 1, the files named, no model
    loaded."""
    result = subprocess.run(
        [sys.executable, "-m", "specserve", "bench", "sessions", "--data-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert "mt_redundant_question.jsonl" in result.stderr and "spec_bench_question.jsonl" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_guard_fails_a_test_that_opens_the_data_beside_the_checkout():
    with pytest.raises(PermissionError, match="tests/data"):
        open(f"{OUTSIDE_DATA[0]}/data/mt_redundant_question.jsonl")


def test_per_category_takes_the_first_questions_of_each_category_in_order():
    questions = [{"question_id": i, "category": c} for i, c in enumerate("aabacbbc")]
    assert [q["question_id"] for q in first_per_category(questions, 2)] == [0, 1, 2, 4, 5, 7]
    assert first_per_category(questions, None) == questions
