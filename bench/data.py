"""Benchmark prompt sets from the shared data folder."""
from __future__ import annotations

import json
from pathlib import Path

DATASET_FILES = {
    "mt-redundant": "mt_redundant_question.jsonl",
    "mt-bench": "mt_bench_question.jsonl",
    "spec-bench": "spec_bench_question.jsonl",
}


def default_data_dir() -> Path:
    """`shared/data` beside the checkout (where CI and developers have it), else inside it."""
    repo = Path(__file__).resolve().parent.parent
    for candidate in (repo.parent / "shared" / "data", repo / "shared" / "data"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("no shared/data folder beside or inside the checkout; pass --data-dir")


def load_questions(name: str, data_dir: Path | None = None) -> list[dict]:
    path = (data_dir or default_data_dir()) / DATASET_FILES[name]
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
