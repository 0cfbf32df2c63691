"""Session benchmark: multi-turn conversations replayed through the HTTP server, sessions off, explicit, implicit,
or continued through the Responses API.

Two conversation sets: MT-Redundant's two turns, and three-turn self-correction conversations built from Spec-Bench's
`math_reasoning` items (write a program, review it, give the final code). One specserve per (session mode, drafter) is
started on loopback up front and warmed up with one short request. The runs are interleaved by conversation: each
conversation is replayed on every server in turn, the others idle, in an order reversed at every other conversation,
so the servers' ratios compare measurements minutes apart, not the tens of minutes over which a shared machine's speed
drifts. One client sends every turn greedily and streamed (so time to first token holds no queueing); each server
keeps its own history, so every turn carries the text that same server returned for the turns before. In `explicit`
mode each request names its session (`X-Session-ID`); in `off` and `implicit` modes none does, as an unmodified client
would not; in `responses` mode each turn goes through the Responses API with only its new user message and the
`previous_response_id` of the turn before (the server keeps the history and maps it onto its session). Each record's
`measured_at_s` says when its request was sent. The result files are rewritten after every conversation, so a run that
dies keeps what it measured; all servers are stopped at the end, also on error. Report rows and files:
bench/sessions_report.py. Memory: every server has its own KV pool of `--kv-cache-memory` GiB, and the default run
starts six (3 modes x 2 drafters) at once, so size the pool for six.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.concurrency import level_order, running_servers, specserve_under_test
from bench.data import load_questions
from bench.sessions_report import ORDER, summary_rows, write_sessions_results
from bench.sse_client import StreamedReply, chat_body, response_body, stream_chat, stream_response
from engine.model.model_source import resolve_model_source

SESSION_HEADER = "X-Session-ID"
SESSION_NAMING_MODES = ("explicit",)  # modes whose requests carry a session id
SERVER_SESSION_MODE = {"responses": "explicit"}  # a server's --session-mode where the bench mode is not one
SELF_CORRECTION_PROMPTS = (
    "Write a Python program that prints the answer to this problem.\n\n{question}",
    "Review your code for mistakes.",
    "Give the final code. If it was right, keep it unchanged.",
)
SELF_CORRECTION_CATEGORY = "math_reasoning"  # Spec-Bench's GSM8K items
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello."}]


@dataclass
class SessionServer:
    """One specserve under test, once started."""
    session_mode: str
    drafter: str
    api_url: str  # its OpenAI base, "http://HOST:PORT/v1"

    @property
    def label(self) -> str:
        return f"{self.session_mode}/{self.drafter}"


@dataclass
class Conversation:
    benchmark: str  # "mt-redundant" or "self-correction"
    question_id: int
    user_turns: list[str]  # [num_turns]

    @property
    def session_id(self) -> str:
        return f"{self.benchmark}-{self.question_id}"


def mt_redundant_conversations(questions: list[dict]) -> list[Conversation]:
    return [Conversation("mt-redundant", q["question_id"], list(q["turns"])) for q in questions]


def self_correction_conversations(spec_bench_questions: list[dict], limit: int | None) -> list[Conversation]:
    """The first LIMIT math_reasoning items, each as the three SELF_CORRECTION_PROMPTS."""
    items = [q for q in spec_bench_questions if q["category"] == SELF_CORRECTION_CATEGORY][:limit]
    return [Conversation("self-correction", q["question_id"], self_correction_turns(q["turns"][0])) for q in items]


def self_correction_turns(question: str) -> list[str]:
    first, *rest = SELF_CORRECTION_PROMPTS
    return [first.format(question=question), *rest]


def build_conversations(benchmarks: list[str], data_dir: Path | None, limit: int | None,
                        self_correction_limit: int | None) -> list[Conversation]:
    conversations = []
    if "mt-redundant" in benchmarks:
        conversations += mt_redundant_conversations(load_questions("mt-redundant", data_dir)[:limit])
    if "self-correction" in benchmarks:
        conversations += self_correction_conversations(load_questions("spec-bench", data_dir), self_correction_limit)
    return conversations


def session_headers(session_mode: str, conversation: Conversation) -> dict[str, str]:
    """The session id header in explicit mode; nothing otherwise (implicit must find the session itself)."""
    return {SESSION_HEADER: conversation.session_id} if session_mode in SESSION_NAMING_MODES else {}


def turn_record(
    conversation: Conversation, turn: int, server: SessionServer, reply: StreamedReply, measured_at_s: float
) -> dict:
    """One request's measurements; times in seconds, MEASURED_AT_S from the first measurement's start to this
    request's."""
    spec = reply.spec_stats or {}
    return {
        "benchmark": conversation.benchmark, "question_id": conversation.question_id,
        "session_mode": server.session_mode,
        "drafter": server.drafter, "turn": turn, "measured_at_s": round(measured_at_s, 1),
        "ttft_s": round(reply.ttft_s, 5), "e2e_s": round(reply.e2e_s, 5),
        "prompt_tokens": reply.prompt_tokens, "cached_tokens": reply.cached_tokens,
        "completion_tokens": reply.completion_tokens, "drafted_tokens": spec.get("drafted_tokens", 0),
        "accepted_tokens": spec.get("accepted_tokens", 0), "num_drafts": spec.get("num_drafts", 0), "text": reply.text,
    }


async def replay_conversation(client: httpx.AsyncClient, server: SessionServer, model: str, conversation: Conversation,
                              max_tokens: int, clock_start: float) -> list[dict]:
    """Every user turn in order, each after SERVER's own earlier answers; one record per turn.

    CLOCK_START: time.perf_counter() (s) when the first measurement started, for each record's `measured_at_s`.
    """
    messages: list[dict] = []
    records = []
    headers = session_headers(server.session_mode, conversation)
    previous_response_id = None
    for turn, user_text in enumerate(conversation.user_turns, start=1):
        messages.append({"role": "user", "content": user_text})
        measured_at_s = time.perf_counter() - clock_start
        if server.session_mode == "responses":  # the server keeps the history: only the new turn goes
            body = response_body(model, user_text, previous_response_id, max_tokens)
            reply = await stream_response(client, server.api_url, body)
            previous_response_id = reply.response_id
        else:
            reply = await stream_chat(client, server.api_url, chat_body(model, messages, max_tokens), headers)
        records.append(turn_record(conversation, turn, server, reply, measured_at_s))
        messages.append({"role": "assistant", "content": reply.text})
    return records


async def replay_interleaved(client: httpx.AsyncClient, servers: list[SessionServer], model: str,
                             conversations: list[Conversation], max_tokens: int,
                             after_conversation: Callable[[list[dict]], None]) -> list[dict]:
    """Each conversation on every server in turn, one at a time, in level_order (reversed at every other conversation).

    Records are kept in server order per conversation; AFTER_CONVERSATION gets the records so far after each one.
    """
    records: list[dict] = []
    clock_start = time.perf_counter()  # s, when the first measurement starts
    progress = tqdm(conversations, desc=f"conversations x {len(servers)} servers")
    for index, conversation in enumerate(progress):
        by_server = {}
        for server_index in level_order(len(servers), index):
            progress.set_postfix_str(servers[server_index].label)
            by_server[server_index] = await replay_conversation(client, servers[server_index], model, conversation,
                                                                max_tokens, clock_start)
        records += [r for server_index in range(len(servers)) for r in by_server[server_index]]
        after_conversation(records)
    return records


async def replay_all(servers: list[SessionServer], model: str, conversations: list[Conversation], max_tokens: int,
                     after_conversation: Callable[[list[dict]], None]) -> list[dict]:
    """replay_interleaved through one client."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        return await replay_interleaved(client, servers, model, conversations, max_tokens, after_conversation)


def measure_servers(settings: list[tuple[str, str]], engine_flags: list[str], model: str,
                    conversations: list[Conversation], max_tokens: int, log_dir: Path,
                    after_conversation: Callable[[list[dict]], None]) -> list[dict]:
    """One specserve per (session mode, drafter) in SETTINGS, all up and warmed up at once, replaying CONVERSATIONS
    interleaved; all stopped on leaving, also on error."""
    under_test = [specserve_under_test(drafter, [*engine_flags, "--session-mode", SERVER_SESSION_MODE.get(mode, mode)],
                                       model) for mode, drafter in settings]
    with running_servers(under_test, [WARMUP_MESSAGES], log_dir) as running:
        servers = [SessionServer(mode, drafter, r.api_url) for (mode, drafter), r in zip(settings, running)]
        return asyncio.run(replay_all(servers, model, conversations, max_tokens, after_conversation))


def run_sessions_benchmark(args, drafters: list[str], engine_flags: list[str], out_dir: Path) -> list[dict]:
    """Every (session mode, drafter) pair, one server each, interleaved by conversation; results rewritten after
    each."""
    out_dir.mkdir(parents=True, exist_ok=True)
    conversations = build_conversations(args.benchmarks, args.data_dir, args.limit, args.self_correction_limit)
    if not conversations:
        raise SystemExit("no conversations to replay (check --limit and --self-correction-limit)")
    model = resolve_model_source(args.model).name
    settings = [(mode, drafter) for mode in args.session_modes for drafter in drafters]
    setup = {"specserve_flags": engine_flags, "max_new_tokens": args.max_new_tokens,
             "session_modes": list(args.session_modes), "drafters": list(drafters), "order": ORDER,
             "self_correction_prompts": list(SELF_CORRECTION_PROMPTS),
             "num_conversations": count_by_benchmark(conversations)}
    command = "specserve " + " ".join(sys.argv[1:])
    records = measure_servers(settings, engine_flags, model, conversations, args.max_new_tokens, out_dir,
                              lambda so_far: write_sessions_results(so_far, command, setup, out_dir))
    for row in summary_rows(records):
        print(json.dumps(row), flush=True)
    return records


def count_by_benchmark(conversations: list[Conversation]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for conversation in conversations:
        counts[conversation.benchmark] = counts.get(conversation.benchmark, 0) + 1
    return counts
