"""Benchmark prompt sets, read from a data folder: `--data-dir`, else bench/data/ (their sources: its README).

Every set comes back as questions of one shape, `{"question_id", "category", "turns"}`,
whatever the file's own layout, so the benchmarks treat them alike; HumanEval's also carry `"completion"`, the
function's signature and docstring as they stand, for base models (`--completions`).
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

HUMANEVAL_PROMPT = (  # EvalPlus's instruct format (bench/data/README.md)
    "Please provide a self-contained Python script that solves the following problem in a markdown code block:\n"
    "```\n{prompt}\n```\n"
)


@dataclass(frozen=True)
class DataSet:
    file: str
    source: str  # where the file comes from, for the message a user sees when it is missing


DATASETS = {
    "mt-redundant": DataSet("mt_redundant_question.jsonl", "github.com/RazvanDu/CopySpec, "
                            "FastChat/fastchat/llm_judge/data/mt_bench/question_redundant.jsonl"),
    "mt-bench": DataSet("mt_bench_question.jsonl",
                        "github.com/lm-sys/FastChat, fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "spec-bench": DataSet("spec_bench_question.jsonl",
                          "github.com/hemingkx/Spec-Bench, data/spec_bench/question.jsonl"),
    "humaneval": DataSet("HumanEval.jsonl.gz", "github.com/openai/human-eval, data/HumanEval.jsonl.gz"),
    "gsm8k": DataSet("gsm8k_test.jsonl", "github.com/openai/grade-school-math, grade_school_math/data/test.jsonl"),
}


class MissingDataError(FileNotFoundError):
    """A benchmark's data file is not where the benchmark looked; the message says what to fetch and where to put it."""


DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data"  # the sets as published, with their sources


def data_path(name: str, data_dir: Path | None = None) -> Path:
    """The file of data set NAME in DATA_DIR (default: bench/data/); MissingDataError if it is not there."""
    path = (data_dir or DEFAULT_DATA_DIR) / DATASETS[name].file
    if not path.is_file():
        raise MissingDataError(missing_data_message([name], data_dir))
    return path


def missing_data_message(names: list[str], data_dir: Path | None) -> str:
    where = f"in {data_dir or DEFAULT_DATA_DIR}"
    lines = [f"benchmark data not found {where}. This benchmark needs:"]
    lines += [f"  {DATASETS[n].file}  (from {DATASETS[n].source})" for n in names]
    lines.append("Download them into one folder and pass it as --data-dir.")
    return "\n".join(lines)


def load_questions(name: str, data_dir: Path | None = None) -> list[dict]:
    path = data_path(name, data_dir)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    if name == "humaneval":
        return [humaneval_question(i, record) for i, record in enumerate(records)]
    if name == "gsm8k":
        return [gsm8k_question(i, record) for i, record in enumerate(records)]
    return records


def humaneval_question(index: int, record: dict) -> dict:
    return {"question_id": index, "category": "humaneval",
            "turns": [HUMANEVAL_PROMPT.format(prompt=record["prompt"].strip())], "completion": record["prompt"]}


def gsm8k_question(index: int, record: dict) -> dict:
    """The question as it stands: the data README gives no prompt format for GSM8K, and the n-gram paper none either."""
    return {"question_id": index, "category": "gsm8k", "turns": [record["question"]]}


def first_per_category(questions: list[dict], per_category: int | None) -> list[dict]:
    """The first PER_CATEGORY questions of each category, in their order (all of them for None)."""
    if per_category is None:
        return questions
    taken: dict[str, int] = {}
    chosen = []
    for question in questions:
        if taken.get(question["category"], 0) < per_category:
            taken[question["category"]] = taken.get(question["category"], 0) + 1
            chosen.append(question)
    return chosen
