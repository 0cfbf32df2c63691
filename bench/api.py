"""API-feature benchmark: MT-Redundant turn 2 with one OpenAI request feature at a time, with and without CopySpec.

Is any request with these fields slower with speculation than without, and is its output still the no-drafter
server's (lossless)? Two specserve servers, `--drafter none` and `--drafter copyspec`, are started on loopback,
warmed up (once plainly, then once per variant, so one-off costs such as compiling a grammar stay out of the
measurements and a rejected field stops the run before any measuring) and fed one request at a time. Both run with
sessions off: every variant repeats a turn-2 prompt the server has answered before, and a session cache would let
CopySpec copy that earlier answer. Per conversation, turn 1 is asked once, plainly, of the `none` server; its answer
goes into the turn-2 history of every variant on both servers (as bench/mt.py puts the baseline's answer into the
next turn). Then each variant's turn 2 goes to both servers back to back, in an order reversed at every other pair,
so each ratio compares requests seconds apart on a machine whose speed drifts. Requests are greedy and not streamed
(tool calls and logprobs come whole); tokens/s = usage completion tokens over the client's wall seconds of the
request, summed over conversations. A server that answers anything but 200 stops the run with its message. Report
rows and files: bench/api_report.py.
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.api_report import write_api_results
from bench.concurrency import WARMUP_MAX_TOKENS, level_order, running_servers, specserve_under_test
from bench.data import load_questions
from bench.mt import interleave_categories
from bench.sessions import WARMUP_MESSAGES
from engine.model.model_source import resolve_model_source

DRAFTERS = ("none", "copyspec")  # the baseline first: every copyspec output must equal its output
DEFAULT_LIMIT = 8  # conversations when --limit is not given
BOOSTED_TEXTS = (" the", " and", ".")  # logit_bias: each one token, raised by LOGIT_BOOST
BANNED_TEXT = " a"  # logit_bias: one common token, lowered by LOGIT_BAN
LOGIT_BOOST, LOGIT_BAN = 2.0, -100.0
# With bounded numbers and no extra keys, the grammar closes every answer within 256 tokens, even at one token
# per character.
MAX_ANSWER_CHARS = 120
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": MAX_ANSWER_CHARS},
                   "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
ANSWER_TOOL = {"type": "function", "function": {
    "name": "answer", "description": "Give the answer.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": MAX_ANSWER_CHARS}},
                   "required": ["text"], "additionalProperties": False}}}
SESSION_FLAGS = ["--session-mode", "off"]


def single_token_id(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{text!r} is {len(ids)} tokens for the served tokenizer; logit_bias needs single tokens")
    return ids[0]


def logit_bias(tokenizer) -> dict[str, float]:
    """Token id (as a JSON key) -> bias: BOOSTED_TEXTS up, BANNED_TEXT out."""
    bias = {str(single_token_id(tokenizer, text)): LOGIT_BOOST for text in BOOSTED_TEXTS}
    return {**bias, str(single_token_id(tokenizer, BANNED_TEXT)): LOGIT_BAN}


VARIANT_FIELDS = {  # each variant's extra request fields, but logit_bias's (built from the served tokenizer)
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    # an extension field: the top-level body field the openai client sends for extra_body={"repetition_penalty": 1.1}
    "repetition_penalty": {"repetition_penalty": 1.1},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}},
    "tool_call": {"tools": [ANSWER_TOOL], "tool_choice": {"type": "function", "function": {"name": "answer"}},
                  "parallel_tool_calls": False},  # one call: a small model repeats calls until max_tokens otherwise
}


def request_variants(tokenizer, names: tuple[str, ...]) -> dict[str, dict]:
    """Each named variant's extra request fields, in the order of NAMES."""
    return {name: {"logit_bias": logit_bias(tokenizer)} if name == "logit_bias" else VARIANT_FIELDS[name]
            for name in names}


def chat_request(model: str, messages: list[dict], max_tokens: int, fields: dict) -> dict:
    """A greedy, unstreamed chat request with FIELDS added."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": False,
            **fields}


def post_chat(client: httpx.Client, api_url: str, body: dict, label: str) -> tuple[dict, float]:
    """The response of one chat request and the client's wall seconds for it; RuntimeError with the server's message
    (LABEL says which request) on any status but 200."""
    start = time.perf_counter()
    response = client.post(api_url + "/chat/completions", json=body)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{label}: {api_url} answered {response.status_code}: {response.text[:500]}")
    return response.json(), seconds


def output_text(message: dict) -> str:
    """The reply as compared between servers: its content, then each tool call's name and arguments."""
    functions = [c["function"] for c in message.get("tool_calls") or []]
    calls = "".join(f"\n[tool {f['name']}] {f['arguments']}" for f in functions)
    return (message.get("content") or "") + calls


def matches_answer_schema(text: str | None) -> bool:
    """TEXT parses as JSON and validates against ANSWER_SCHEMA (with jsonschema where installed, else by hand)."""
    try:
        value = json.loads(text or "")
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:
        confidence = value.get("confidence") if isinstance(value, dict) else None
        return (isinstance(value, dict) and isinstance(value.get("answer"), str)
                and isinstance(confidence, (int, float)) and not isinstance(confidence, bool))
    return jsonschema.Draft202012Validator(ANSWER_SCHEMA).is_valid(value)


def tool_call_parses(message: dict) -> bool:
    """One call of ANSWER_TOOL whose arguments are a JSON object with a string `text`."""
    calls = message.get("tool_calls") or []
    if len(calls) != 1 or calls[0].get("function", {}).get("name") != "answer":
        return False
    try:
        arguments = json.loads(calls[0]["function"].get("arguments") or "")
    except json.JSONDecodeError:
        return False
    return isinstance(arguments, dict) and isinstance(arguments.get("text"), str)


def output_is_valid(variant: str, message: dict) -> bool | None:
    """Whether a structured variant's output has its structure; None for the others."""
    if variant == "json_schema":
        return matches_answer_schema(message.get("content"))
    if variant == "tool_call":
        return tool_call_parses(message)
    return None


def turn2_record(question: dict, variant: str, drafter: str, response: dict, seconds: float,
                 measured_at_s: float) -> dict:
    """One turn-2 request's measurements; SECONDS its wall time, MEASURED_AT_S from the run's first request to its
    own."""
    choice, spec = response["choices"][0], response.get("spec_stats") or {}
    return {
        "question_id": question["question_id"], "category": question["category"], "variant": variant,
        "drafter": drafter, "measured_at_s": round(measured_at_s, 1), "seconds": round(seconds, 4),
        "completion_tokens": response["usage"]["completion_tokens"], "finish_reason": choice.get("finish_reason"),
        "drafted_tokens": spec.get("drafted_tokens", 0), "accepted_tokens": spec.get("accepted_tokens", 0),
        "num_drafts": spec.get("num_drafts", 0), "valid": output_is_valid(variant, choice["message"]),
        "text": output_text(choice["message"]),
    }


def turn2_messages(client: httpx.Client, api_url: str, model: str, question: dict, max_tokens: int) -> list[dict]:
    """Turn 1, its plain greedy answer from the server at API_URL, and turn 2."""
    body = chat_request(model, [{"role": "user", "content": question["turns"][0]}], max_tokens, {})
    response, _ = post_chat(client, api_url, body, f"question {question['question_id']}, turn 1")
    answer = response["choices"][0]["message"]["content"]
    return [{"role": "user", "content": question["turns"][0]}, {"role": "assistant", "content": answer},
            {"role": "user", "content": question["turns"][1]}]


def measure_question(client: httpx.Client, api_urls: dict[str, str], model: str, question: dict,
                     variants: dict[str, dict], max_tokens: int, first_pair: int, clock_start: float) -> list[dict]:
    """Every variant's turn 2 on every server in API_URLS (drafter -> OpenAI base), back to back; the FIRST_PAIR-th
    (variant, conversation) pair of the run decides the order (level_order). Records in variant, then drafter order.

    CLOCK_START: time.perf_counter() (s) when the run's first request was sent."""
    messages = turn2_messages(client, api_urls["none"], model, question, max_tokens)
    drafters, records = list(api_urls), []
    for pair, (variant, fields) in enumerate(variants.items(), start=first_pair):
        by_drafter = {}
        for drafter in (drafters[i] for i in level_order(len(drafters), pair)):
            measured_at_s = time.perf_counter() - clock_start
            label = f"variant {variant} on --drafter {drafter}, question {question['question_id']}"
            body = chat_request(model, messages, max_tokens, fields)
            response, seconds = post_chat(client, api_urls[drafter], body, label)
            by_drafter[drafter] = turn2_record(question, variant, drafter, response, seconds, measured_at_s)
        records += [by_drafter[drafter] for drafter in drafters]
    return records


def warm_up_variants(client: httpx.Client, api_urls: dict[str, str], model: str, variants: dict[str, dict]) -> None:
    """One short untimed request per variant and server: a field the server rejects stops the run here."""
    for variant, fields in variants.items():
        for drafter, api_url in api_urls.items():
            body = chat_request(model, WARMUP_MESSAGES, WARMUP_MAX_TOKENS, fields)
            post_chat(client, api_url, body, f"warm-up of variant {variant} on --drafter {drafter}")


def measure_all(client: httpx.Client, api_urls: dict[str, str], model: str, questions: list[dict],
                variants: dict[str, dict], max_tokens: int, after_question: Callable[[list[dict]], None]) -> list[dict]:
    """warm_up_variants, then every question (measure_question); AFTER_QUESTION gets the records so far after each."""
    warm_up_variants(client, api_urls, model, variants)
    records: list[dict] = []
    clock_start = time.perf_counter()  # s, when the first measured request is sent
    progress = tqdm(questions, desc=f"conversations x {len(variants)} variants x {len(api_urls)} servers")
    for index, question in enumerate(progress):
        first_pair = index * len(variants)
        records += measure_question(client, api_urls, model, question, variants, max_tokens, first_pair, clock_start)
        after_question(records)
    return records


def run_api_benchmark(args, engine_flags: list[str], tokenizer, out_dir: Path) -> dict:
    """Both servers up and warmed up, every question measured (results rewritten after each), both stopped at the
    end."""
    out_dir.mkdir(parents=True, exist_ok=True)
    limit = DEFAULT_LIMIT if args.limit is None else args.limit
    questions = interleave_categories(load_questions("mt-redundant", args.data_dir))[:limit]
    if not questions:
        raise SystemExit("no conversations to measure (check --limit)")
    variants = request_variants(tokenizer, args.variants)
    model = resolve_model_source(args.model).name
    flags = [*engine_flags, *SESSION_FLAGS]
    setup = {"specserve_flags": flags, "max_new_tokens": args.max_new_tokens, "num_conversations": len(questions),
             "variants": variants}
    command = "specserve " + shlex.join(sys.argv[1:])
    results: dict = {}

    def write(records: list[dict]) -> None:
        results.update(write_api_results(records, command, setup, out_dir))

    with running_servers(
        [specserve_under_test(d, flags, model) for d in DRAFTERS], [WARMUP_MESSAGES], out_dir
    ) as running:
        api_urls = {drafter: server.api_url for drafter, server in zip(DRAFTERS, running)}
        with httpx.Client(timeout=httpx.Timeout(3600.0)) as client:
            measure_all(client, api_urls, model, questions, variants, args.max_new_tokens, write)
    return results
