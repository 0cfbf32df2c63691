"""The session benchmark: conversations from the data files, session ids, rows, ratios and report files."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from bench.cli import SESSION_BENCHMARKS, specserve_engine_flags
from bench.data import load_questions
from bench.sessions import (
    SELF_CORRECTION_PROMPTS,
    Conversation,
    SessionServer,
    build_conversations,
    replay_conversation,
    replay_interleaved,
    self_correction_conversations,
    session_headers,
    turn_record,
)
from bench.sessions_report import ORDER, ORDER_NOTE, speed_ratios, summary_rows, ttft_ratios, write_sessions_results
from bench.sse_client import StreamedReply
from server.cli import engine_config
from specserve import build_parser
from tests.conftest import TEST_DATA_DIR


def record(mode: str, drafter: str, turn: int, question_id: int, text: str, ttft_s: float, e2e_s: float = 1.0,
           completion: int = 10, accepted: int = 0, num_drafts: int = 0, cached: int = 0,
           benchmark: str = "mt-redundant") -> dict:
    return {"benchmark": benchmark, "question_id": question_id, "session_mode": mode, "drafter": drafter, "turn": turn,
            "ttft_s": ttft_s, "e2e_s": e2e_s, "prompt_tokens": 100, "cached_tokens": cached,
            "completion_tokens": completion, "drafted_tokens": 2 * accepted, "accepted_tokens": accepted,
            "num_drafts": num_drafts, "text": text}


def hand_made_records() -> list[dict]:
    """Two conversations, turn 2 only, for off/none, off/copyspec, explicit/none and explicit/copyspec."""
    return [
        record("off", "none", 2, 1, "a", 0.9), record("off", "none", 2, 2, "b", 1.1),
        record("off", "copyspec", 2, 1, "a", 0.8, e2e_s=0.5, accepted=6, num_drafts=2),
        record("off", "copyspec", 2, 2, "b", 1.0, e2e_s=0.5, accepted=2, num_drafts=2),
        record("explicit", "none", 2, 1, "a", 0.2, cached=90), record("explicit", "none", 2, 2, "B", 0.4, cached=80),
        record("explicit", "copyspec", 2, 1, "a", 0.1, e2e_s=0.25, accepted=8, num_drafts=2, cached=90),
        record("explicit", "copyspec", 2, 2, "b", 0.3, e2e_s=0.25, accepted=8, num_drafts=4, cached=80),
    ]


def test_mt_redundant_conversations_are_the_first_questions_with_both_turns():
    conversations = build_conversations(["mt-redundant"], TEST_DATA_DIR, 3, None)
    questions = load_questions("mt-redundant", TEST_DATA_DIR)[:3]
    assert [c.question_id for c in conversations] == [q["question_id"] for q in questions]
    assert all(c.benchmark == "mt-redundant" and c.user_turns == q["turns"] for c, q in zip(conversations, questions))
    assert conversations[0].session_id == f"mt-redundant-{questions[0]['question_id']}"


def test_self_correction_conversations_ask_three_turns_about_math_reasoning_items():
    spec_bench = load_questions("spec-bench", TEST_DATA_DIR)
    items = [q for q in spec_bench if q["category"] == "math_reasoning"]
    conversations = self_correction_conversations(spec_bench, 2)
    assert [c.question_id for c in conversations] == [q["question_id"] for q in items[:2]]
    first = conversations[0]
    assert len(first.user_turns) == 3 and first.benchmark == "self-correction"
    assert (first.user_turns[0].startswith("Write a Python program")
            and first.user_turns[0].endswith(items[0]["turns"][0]))
    assert first.user_turns[1:] == list(SELF_CORRECTION_PROMPTS[1:])
    assert len(self_correction_conversations(spec_bench, None)) == len(items) == 3


def test_both_benchmarks_with_their_own_limits():
    conversations = build_conversations(list(SESSION_BENCHMARKS), TEST_DATA_DIR, 2, 3)
    assert [c.benchmark for c in conversations] == ["mt-redundant"] * 2 + ["self-correction"] * 3


@pytest.mark.parametrize(
    "mode, expected", [("off", {}), ("implicit", {}), ("explicit", {"X-Session-ID": "self-correction-7"})]
)
def test_only_explicit_mode_names_the_session(mode, expected):
    assert session_headers(mode, Conversation("self-correction", 7, ["q"])) == expected


def sse(text: str, cached: int | None) -> bytes:
    usage = {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    spec = {"drafted_tokens": 3, "accepted_tokens": 1, "num_drafts": 1, "mean_acceptance_length": 2.0}
    chunks = [{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": text}}]},
              {"choices": [{"delta": {}, "finish_reason": "length"}], "spec_stats": spec},
              {"choices": [], "usage": usage, "spec_stats": spec}]
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("mode", ["off", "explicit", "implicit"])
def test_replay_sends_the_servers_own_answers_and_the_header_only_in_explicit_mode(mode):
    """An in-memory transport answers turn N with "answer N" and reports cached tokens from turn 2 on."""
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers.get("X-Session-ID"), json.loads(request.content)))
        turn = len(seen)
        return httpx.Response(200, content=sse(f"answer {turn}", 15 if turn > 1 else None))

    async def replay() -> list[dict]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            conversation = Conversation("self-correction", 401, ["one", "two", "three"])
            server = SessionServer(mode, "copyspec", "http://test/v1")
            return await replay_conversation(client, server, "m", conversation, 8, time.perf_counter())

    records = asyncio.run(replay())
    assert [header for header, _ in seen] == (["self-correction-401"] * 3 if mode == "explicit" else [None] * 3)
    last_messages = seen[-1][1]["messages"]
    assert [m["content"] for m in last_messages] == ["one", "answer 1", "two", "answer 2", "three"]
    assert all(
        body["temperature"] == 0 and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 8
        for _, body in seen
    )
    assert [r["cached_tokens"] for r in records] == [0, 15, 15]
    assert [(r["turn"], r["text"], r["completion_tokens"], r["accepted_tokens"], r["num_drafts"]) for r in records] == [
        (1, "answer 1", 2, 1, 1), (2, "answer 2", 2, 1, 1), (3, "answer 3", 2, 1, 1)]
    assert all(r["session_mode"] == mode and r["drafter"] == "copyspec" and r["measured_at_s"] >= 0 for r in records)


def test_interleaved_replay_alternates_the_server_order_and_keeps_each_servers_history():
    """Three in-memory servers (by host) answer "HOST N" to their N-th request; two conversations of two turns."""
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        seen.append((host, [m["content"] for m in json.loads(request.content)["messages"]]))
        return httpx.Response(200, content=sse(f"{host} {sum(h == host for h, _ in seen)}", None))

    servers = [SessionServer("off", "none", "http://a/v1"), SessionServer("implicit", "none", "http://b/v1"),
               SessionServer("implicit", "copyspec", "http://c/v1")]
    conversations = [Conversation("mt-redundant", 1, ["q1", "q2"]), Conversation("mt-redundant", 2, ["r1", "r2"])]
    written = []

    async def replay() -> list[dict]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await replay_interleaved(client, servers, "m", conversations, 8,
                                            lambda so_far: written.append(list(so_far)))

    records = asyncio.run(replay())
    assert [host for host, _ in seen] == ["a", "a", "b", "b", "c", "c", "c", "c", "b", "b", "a", "a"]
    assert ("b", ["r1", "b 3", "r2"]) in seen and ("c", ["q1", "c 1", "q2"]) in seen
    in_server_order = [(q, mode, drafter, turn) for q in (1, 2) for mode, drafter in
                       (("off", "none"), ("implicit", "none"), ("implicit", "copyspec")) for turn in (1, 2)]
    assert [(r["question_id"], r["session_mode"], r["drafter"], r["turn"]) for r in records] == in_server_order
    assert [len(w) for w in written] == [6, 12] and written[-1] == records
    times = {(r["question_id"], r["session_mode"], r["drafter"], r["turn"]): r["measured_at_s"] for r in records}
    sent_order = [(1, "off", "none"), (1, "implicit", "none"), (1, "implicit", "copyspec"),
                  (2, "implicit", "copyspec"), (2, "implicit", "none"), (2, "off", "none")]
    in_sending_order = [times[(*server, turn)] for server in sent_order for turn in (1, 2)]
    assert in_sending_order == sorted(in_sending_order) and in_sending_order[0] >= 0


def test_interleaved_replay_keeps_finished_conversations_when_a_server_fails():
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "b" and b"r1" in request.content:
            return httpx.Response(500, content=b"engine died")
        return httpx.Response(200, content=sse("fine", None))

    servers = [SessionServer("off", "none", "http://a/v1"), SessionServer("implicit", "none", "http://b/v1")]
    conversations = [Conversation("mt-redundant", 1, ["q1"]), Conversation("mt-redundant", 2, ["r1"])]
    written = []

    async def replay() -> list[dict]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await replay_interleaved(client, servers, "m", conversations, 8,
                                            lambda so_far: written.append(list(so_far)))

    with pytest.raises(RuntimeError, match="answered 500"):
        asyncio.run(replay())
    assert [[(r["question_id"], r["session_mode"]) for r in w] for w in written] == [[(1, "off"), (1, "implicit")]]


def test_a_reply_without_usage_or_spec_stats_counts_text_chunks_and_zeros():
    reply = StreamedReply("abc", 0.1, 0.5, 0.4, 3, None, None)
    result = turn_record(
        Conversation("mt-redundant", 81, ["q"]), 1, SessionServer("off", "none", "http://test/v1"), reply, 2.34
    )
    assert (result["completion_tokens"], result["cached_tokens"], result["prompt_tokens"]) == (3, 0, 0)
    assert (result["drafted_tokens"], result["accepted_tokens"], result["num_drafts"]) == (0, 0, 0)
    assert result["measured_at_s"] == 2.3


def test_summary_rows_pool_each_turns_requests():
    rows = {(r["session_mode"], r["drafter"]): r for r in summary_rows(hand_made_records())}
    assert list(rows) == [("off", "none"), ("off", "copyspec"), ("explicit", "none"), ("explicit", "copyspec")]
    base, copy, explicit_copy = rows["off", "none"], rows["off", "copyspec"], rows["explicit", "copyspec"]
    assert ((base["ttft_p50_s"], base["tokens_per_s"], base["mean_acceptance_length"], base["copied_fraction"])
            == (1.0, 10.0, 1.0, 0.0))
    assert (copy["tokens_per_s"], copy["copied_fraction"], copy["mean_acceptance_length"]) == (20.0, 0.4, 3.0)
    assert (explicit_copy["mean_acceptance_length"], explicit_copy["cached_tokens_mean"]) == (3.667, 85.0)
    assert [r["outputs_equal_baseline"] for r in rows.values()] == [2, 2, 1, 2]
    assert all(r["num_conversations"] == 2 and r["completion_tokens"] == 20 and r["turn"] == 2 for r in rows.values())


def test_without_a_baseline_server_equality_is_unknown():
    rows = summary_rows([record("implicit", "copyspec", 1, 1, "a", 0.5)])
    assert rows[0]["outputs_equal_baseline"] is None


def test_ttft_ratios_are_off_over_each_session_mode():
    ratios = {(q["numerator"], q["denominator"]): q["ratio"] for q in ttft_ratios(summary_rows(hand_made_records()))}
    assert ratios == {("off/none", "explicit/none"): round(1.0 / 0.3, 3), ("off/copyspec", "explicit/copyspec"): 4.5}


def test_speed_ratios_are_each_drafter_over_none_in_its_mode_and_over_off_none():
    ratios = {(q["numerator"], q["denominator"]): q["ratio"] for q in speed_ratios(summary_rows(hand_made_records()))}
    assert ratios == {("off/copyspec", "off/none"): 2.0, ("explicit/copyspec", "explicit/none"): 4.0,
                      ("explicit/copyspec", "off/none"): 4.0}


def test_report_files(tmp_path):
    setup = {"num_conversations": {"mt-redundant": 2}, "max_new_tokens": 8, "specserve_flags": [], "order": ORDER}
    write_sessions_results(hand_made_records()[:1], "specserve bench sessions", setup, tmp_path)
    assert "Conversations: 1 of 2 mt-redundant (so far);" in (tmp_path / "results.md").read_text()
    write_sessions_results(hand_made_records(), "specserve bench sessions", setup, tmp_path)
    results = json.loads(
        (tmp_path / "results.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-finite {c}")
    )
    wanted = {"ttft_p50_s", "tokens_per_s", "copied_fraction", "mean_acceptance_length", "outputs_equal_baseline"}
    assert wanted <= results["summary"][0].keys()
    assert {q["metric"] for q in results["ratios"]} == {"ttft_p50_s", "tokens_per_s"}
    texts = [(r["session_mode"], r["drafter"], r.get("text"), r["equal_baseline"]) for r in results["records"]]
    assert ("explicit", "none", "B", False) in texts and ("explicit", "copyspec", None, True) in texts
    assert all(text is not None for mode, drafter, text, _ in texts if (mode, drafter) == ("off", "none"))
    assert results["conversations_measured"] == {"mt-redundant": 2} and results["setup"]["order"] == ORDER
    markdown = (tmp_path / "results.md").read_text()
    assert "Command: `specserve bench sessions`" in markdown and ORDER_NOTE in markdown
    assert "Conversations: 2 mt-redundant;" in markdown
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md", "ttft_and_speed.png"]
    assert "| mt-redundant | explicit | none | 2 | 2 | 0.300 | 10.0 | 0.00 | 1.00 | 100 | 85 | 1 |" in markdown
    assert "| mt-redundant | 2 | 3.33 | 4.50 |" in markdown and "off/none ÷ explicit/none" in markdown
    assert (tmp_path / "ttft_and_speed.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_runs_off_first_and_passes_engine_flags_on():
    args = build_parser().parse_args(
        ["bench", "sessions", "--session-modes", "implicit,off", "--kv-cache-memory", "0.5"]
    )
    assert args.session_modes == ("off", "implicit") and args.benchmarks == SESSION_BENCHMARKS
    assert args.self_correction_limit == 20
    flags = specserve_engine_flags(engine_config(args))
    assert flags[flags.index("--kv-cache-memory") + 1] == "0.5"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "sessions", "--session-modes", "sometimes"])


@pytest.mark.slow
def test_smoke_sessions_off_and_implicit_against_real_servers(tmp_path, capsys):
    """One conversation of each benchmark, 8 tokens a turn, through two real servers (off and implicit, no drafter)."""
    from specserve import main

    main(["bench", "sessions", "--session-modes", "implicit", "--drafters", "none", "--limit", "1",
          "--self-correction-limit", "1", "--max-new-tokens", "8", "--kv-cache-memory", "0.25", "--out", str(tmp_path),
          "--data-dir", str(TEST_DATA_DIR)])
    results = json.loads((tmp_path / "results.json").read_text())
    summary = results["summary"]
    assert [(r["benchmark"], r["turn"], r["session_mode"]) for r in summary] == [
        (b, t, m) for b, turns in (("mt-redundant", 2), ("self-correction", 3))
        for t in range(1, turns + 1) for m in ("off", "implicit")]
    assert all(r["outputs_equal_baseline"] == 1 for r in summary)
    assert all(r["cached_tokens_mean"] == 0 for r in summary if r["session_mode"] == "off")
    assert all(r["cached_tokens_mean"] > 0 for r in summary if r["session_mode"] == "implicit" and r["turn"] > 1)
    assert results["setup"]["order"] == ORDER and all(r["measured_at_s"] >= 0 for r in results["records"])
    assert (tmp_path / "results.md").is_file() and (tmp_path / "ttft_and_speed.png").is_file()
    assert "| mt-redundant | 2 |" in capsys.readouterr().out
