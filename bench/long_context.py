"""`specserve bench long-context`: a long Python file continued from contexts past a sliding window, and the served
model checked against its own definition there.

The text is HumanEval's 164 problems with their canonical solutions, one after another: one Python file of about
30,000 tokens (bench/data). For each context length C (default 700, 1,500 and 3,000 tokens: past Gemma 3's
512-token window) its first C tokens are continued greedily, as a base model is used, by every runner of
`--drafters` (specserve per drafter, llama-server on the same GGUF), through the conversation benchmark's machinery
(bench/mt.py, one "question" per context).

`--definition-tokens N` (default 40) also continues each context N tokens with specserve under `--weights float32`
and with transformers' eager float32 forward of the same weights: equal tokens, and where they part whether the
reference's top two logits nearly tie there (bench/exactness.py).
"""
from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import torch

from bench.data import data_path
from bench.exactness import divergence_verdict, first_difference
from bench.runners import EngineRunner
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.gguf_cache import loadable_source
from engine.model.model_source import resolve_model_source

CONTEXTS = (700, 1500, 3000)


def long_code(data_dir: Path | None) -> str:
    """HumanEval's prompts and canonical solutions as one Python file."""
    with gzip.open(data_path("humaneval", data_dir), "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return "\n\n".join(record["prompt"] + record["canonical_solution"] for record in records)


def context_questions(tokenizer, text: str, contexts: tuple[int, ...]) -> list[dict]:
    """One question per context length: the text cut after that many tokens, as text to continue."""
    ids = tokenizer.encode(text)
    if len(ids) < max(contexts):
        raise SystemExit(f"the long text has {len(ids)} tokens, fewer than the longest context {max(contexts)}")
    return [{"question_id": n, "category": f"{n} tokens", "turns": [""],
             "completion": tokenizer.decode(ids[:n], skip_special_tokens=True)} for n in contexts]


@torch.inference_mode()
def definition_check(config: EngineConfig, questions: list[dict], tokenizer, num_tokens: int) -> list[dict]:
    """Per context: specserve's greedy tokens (--weights float32, plain decoding) against transformers' eager
    float32 forward of the same checkpoint."""
    from transformers import AutoModelForCausalLM  # local: the benchmark's speed part never loads the eager model

    engine = EngineRunner(Engine(replace(config, model=replace(config.model, weights="float32"))))
    path = loadable_source(resolve_model_source(config.model.model)).path
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    rows = []
    for question in questions:
        prompt = list(tokenizer.encode(question["completion"]))
        reference = eager.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                   do_sample=False)[0, len(prompt):].tolist()
        served = engine.generate(prompt, num_tokens).token_ids
        part = first_difference(reference, served)
        rows.append({"context_tokens": len(prompt), "equal_tokens": num_tokens if part is None else part,
                     "of": num_tokens, "verdict": divergence_verdict(eager, prompt, reference, served)})
    return rows


def definition_markdown(rows: list[dict]) -> str:
    lines = ["", "Against the model's own definition (specserve `--weights float32`, plain decoding, vs transformers' "
             "eager float32 forward):", "", "| context tokens | equal tokens | verdict |", "|---|---|---|"]
    lines += [f"| {r['context_tokens']} | {r['equal_tokens']} of {r['of']} | {r['verdict']} |" for r in rows]
    return "\n".join(lines) + "\n"
