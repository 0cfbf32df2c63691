"""Agentic traffic for `specserve bench spectra --agentic N`: N requests from separate conversations whose answers
share structure — each asks for one JSON record over the same schema, about a different person — sent one after
another. No conversation holds another's answer, so only an index across requests (SPECTRA's traffic index,
drafters/retrieval.py) can draft one record from the records before it."""
from __future__ import annotations

import random

from bench.mt import render_prompt

NAMES = ("Alice", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena",
         "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara")
CITIES = ("Lisbon", "Osaka", "Nairobi", "Toronto", "Krakow", "Lima", "Hanoi", "Oslo", "Austin", "Porto")
JOBS = ("nurse", "welder", "teacher", "pilot", "chemist", "baker", "architect", "librarian", "farmer", "editor")
SCHEMA = ('{"name": string, "age": integer, "city": string, "job": string, "email": string, '
          '"skills": [string, string], "active": boolean}')


def agentic_questions(count: int, seed: int = 0) -> list[dict]:
    """COUNT requests for one record each over SCHEMA, about a different person (question_id agentic-i)."""
    rng = random.Random(seed)
    questions = []
    for i in range(count):
        name, age, city, job = rng.choice(NAMES), rng.randrange(21, 70), rng.choice(CITIES), rng.choice(JOBS)
        text = f"Return only a JSON object matching this schema: {SCHEMA}. The person: {name}, {age} years old, " \
               f"a {job} in {city}."
        questions.append({"question_id": f"agentic-{i}", "turns": [text]})
    return questions


def agentic_prompts(tokenizer, count: int) -> list[tuple[dict, list[int]]]:
    return [(q, render_prompt(tokenizer, [{"role": "user", "content": q["turns"][0]}]))
            for q in agentic_questions(count)]
