"""Agentic traffic for `specserve bench spectra --agentic N`: N requests from separate conversations whose answers
repeat each other although no prompt holds them, sent one after another.

Each request is a code-writing agent's call for one small Python function: one of TASKS, under a name made of a verb
from VERBS and the task's noun. The answers are the same few functions emitted again under other names (and the same
explanations after them): no conversation holds another's answer, and no prompt holds the code, so only an index
across requests (SPECTRA's traffic index, drafters/retrieval.py) can draft one answer from the answers before it.

A workload whose prompts hold the shared structure does not isolate the index: with one JSON schema written into
every prompt (the records this benchmark first sent), the core copies the keys from the prompt itself and the index
added 1.04x (bench/README.md, SPECTRA).
"""
from __future__ import annotations

import random

from bench.mt import render_prompt

TASKS = (
    ("average", "takes a list of numbers and returns their average"),
    ("largest", "takes a list of numbers and returns the largest one"),
    ("reverse", "takes a string and returns it reversed"),
    ("count_words", "takes a string and returns how many words it has"),
)
VERBS = ("get", "compute", "find", "calc", "my", "do")


def agentic_questions(count: int, seed: int = 0) -> list[dict]:
    """COUNT requests for one function each: a task of TASKS drawn at random, named verb_noun (question_id
    agentic-i)."""
    rng = random.Random(seed)
    questions = []
    for i in range(count):
        noun, what = rng.choice(TASKS)
        text = f"Write a Python function named `{rng.choice(VERBS)}_{noun}` that {what}."
        questions.append({"question_id": f"agentic-{i}", "turns": [text]})
    return questions


def agentic_prompts(tokenizer, count: int) -> list[tuple[dict, list[int]]]:
    return [(q, render_prompt(tokenizer, [{"role": "user", "content": q["turns"][0]}]))
            for q in agentic_questions(count)]
