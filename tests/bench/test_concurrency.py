"""The concurrency benchmark's bookkeeping: rows, ratios, report files, peer setup, process start-up and the
interleaved measuring order (all servers up at once, driven one after another at each level)."""
from __future__ import annotations

import json
import math
import sys

import httpx
import pytest

from bench.concurrency import (
    ORDER_NOTE,
    PEER_ENV,
    PEER_MIN_BLOCKS,
    PEER_PAGE_SIZE,
    RequestTiming,
    ServerUnderTest,
    drive_levels,
    level_batches,
    level_order,
    markdown_report,
    measure_servers,
    peer_device_and_dtype,
    peer_num_blocks,
    scrape_spec_counters,
    summary_row,
    throughput_ratios,
    transformers_model_dir,
    transformers_serve_under_test,
    write_concurrency_results,
)
from bench.server_process import free_port, start_process, stop_server
from engine.model.model_source import ModelSource

SPEC_KEYS = ("mean_acceptance_length", "drafted_tokens", "verified_draft_tokens", "engine_step_ms",
             "engine_busy_fraction")
# A stand-in OpenAI server: /health answers 200, no /metrics; each chat request appends its `model` to LOG (and its
# session header and max_tokens to LOG.sessions and LOG.max_tokens) and streams two tokens.
STAND_IN_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, log = int(sys.argv[1]), sys.argv[2]
CHUNKS = [{"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]},
          {"choices": [], "usage": {"completion_tokens": 2}}]
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(log, "a") as f:
            f.write(body["model"] + "\\n")
        with open(log + ".sessions", "a") as f:
            f.write((self.headers.get("X-Session-ID") or "-") + "\\n")
        with open(log + ".max_tokens", "a") as f:
            f.write(str(body["max_tokens"]) + "\\n")
        with open(log + ".paths", "a") as f:
            f.write(self.path + "\\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in CHUNKS:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n\\n")
        self.wfile.write(b"data: [DONE]\\n\\n")
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def under_test(server: str, drafter: str) -> ServerUnderTest:
    return ServerUnderTest(server, drafter, ["true"], 1, "m")


def timings() -> list[RequestTiming]:
    return [RequestTiming(0.5, 0.05, 10), RequestTiming(1.5, 0.07, 30), RequestTiming(1.0, 0.06, 20)]


def row(concurrency: int, server: str, drafter: str, tokens_per_s: float) -> dict:
    spec = None if server != "specserve" else {"drafts": 0.0, "accepted": 0.0, "offered": 0.0, "verified": 0.0,
                                               "steps": 0.0, "step_seconds": 0.0}
    return {**summary_row(under_test(server, drafter), concurrency, timings(), 1.0, spec), "tokens_per_s": tokens_per_s}


def test_summary_row_of_a_peer_has_null_speculative_columns():
    result = summary_row(under_test("transformers-serve", "none"), 4, timings(), 2.0, None)
    assert result["tokens_per_s"] == 30.0
    assert result["ttft_p50_s"] == 1.0 and result["ttft_p99_s"] == 1.5
    assert result["itl_p50_s"] == 0.06
    assert all(result[key] is None for key in SPEC_KEYS)
    json.dumps(result, allow_nan=False)


def test_summary_row_of_specserve_counts_drafts_and_engine_steps():
    spec = {"drafts": 4.0, "accepted": 6.0, "offered": 20.0, "verified": 12.0, "steps": 8.0, "step_seconds": 0.4}
    result = summary_row(under_test("specserve", "copyspec"), 1, timings(), 2.0, spec)
    assert result["mean_acceptance_length"] == 2.5
    assert (result["drafted_tokens"], result["verified_draft_tokens"]) == (20, 12)
    assert result["engine_step_ms"] == 50.0 and result["engine_busy_fraction"] == 0.2  # 0.4 s of 2 s stepping
    plain = summary_row(under_test("specserve", "none"), 1, timings(), 1.0, dict.fromkeys(spec, 0.0))
    assert (plain["mean_acceptance_length"], plain["drafted_tokens"], plain["verified_draft_tokens"]) == (1.0, 0, 0)


def test_ratios_per_concurrency():
    rows = [row(c, s, d, v) for c, s, d, v in [
        (1, "specserve", "none", 10.0), (1, "specserve", "copyspec", 15.0), (1, "transformers-serve", "none", 5.0),
        (16, "specserve", "none", 40.0), (16, "specserve", "copyspec", 80.0), (16, "transformers-serve", "none", 20.0),
        (16, "llama-server-spec", "ngram-map-k", 50.0),  # a peer's own speculation: its row names the drafter
    ]]
    ratios = {(q["concurrency"], q["numerator"], q["denominator"]): q["ratio"] for q in throughput_ratios(rows)}
    assert ratios == {
        (1, "specserve/copyspec", "specserve/none"): 1.5,
        (1, "specserve/none", "transformers-serve/none"): 2.0,
        (1, "specserve/copyspec", "transformers-serve/none"): 3.0,
        (16, "specserve/copyspec", "specserve/none"): 2.0,
        (16, "specserve/none", "transformers-serve/none"): 2.0,
        (16, "specserve/copyspec", "transformers-serve/none"): 4.0,
        (16, "specserve/none", "llama-server-spec/ngram-map-k"): 0.8,
        (16, "specserve/copyspec", "llama-server-spec/ngram-map-k"): 1.6,
    }


def test_report_files(tmp_path):
    rows = [row(1, "specserve", "none", 10.0), row(1, "transformers-serve", "none", 5.0),
            row(2, "specserve", "none", 18.0), row(2, "transformers-serve", "none", 9.0)]
    write_concurrency_results(rows, "specserve bench concurrency", tmp_path, {"specserve_flags": []})
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(r["concurrency"], r["server"], r["drafter"]) for r in results["summary"]] == [
        (1, "specserve", "none"),
        (1, "transformers-serve", "none"),
        (2, "specserve", "none"),
        (2, "transformers-serve", "none"),
    ]
    for r in results["summary"]:
        assert {"tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", *SPEC_KEYS} <= r.keys()
    assert [q["ratio"] for q in results["ratios"]] == [2.0, 2.0]
    markdown = (tmp_path / "results.md").read_text()
    assert ORDER_NOTE in markdown
    assert "| 1 | transformers-serve | none | 5.0 |" in markdown and "| – | – | – |" in markdown
    assert "specserve/none ÷ transformers-serve/none" in markdown and "| 2 | 2.00 |" in markdown
    assert (tmp_path / "throughput.png").read_bytes()[:4] == b"\x89PNG"


def test_markdown_without_peers_has_no_peer_ratio():
    text = markdown_report([row(1, "specserve", "none", 10.0)], [], "cmd")
    assert "÷" not in text


def test_peer_kv_blocks_cover_the_largest_level():
    assert peer_num_blocks([100, 300], 64, 256) == 64 * math.ceil(556 / PEER_PAGE_SIZE) + 1
    assert peer_num_blocks([10], 1, 16) == PEER_MIN_BLOCKS


def test_peer_device_and_dtype_follow_specserve():
    assert peer_device_and_dtype("cpu", "auto") == ("cpu", "float32")
    assert peer_device_and_dtype("cuda", "auto") == ("cuda", "bfloat16")
    assert peer_device_and_dtype("cpu", "bfloat16") == ("cpu", "bfloat16")


def test_transformers_serve_command_is_offline_continuous_batching():
    peer = transformers_serve_under_test("/models/m", "cpu", "float32", 40, 512)
    assert peer.model == "/models/m"  # transformers serve answers only requests naming the pinned model
    assert peer.command[3:5] == ["serve", "/models/m"]
    assert "--continuous-batching" in peer.command
    flags = dict(zip(peer.command[5::1], peer.command[6::1]))
    assert flags["--cb-num-blocks"] == "40" and flags["--cb-max-batch-tokens"] == "512" and flags["--device"] == "cpu"
    assert peer.env == PEER_ENV and peer.env["HF_HUB_OFFLINE"] == "1"


def test_a_plain_model_directory_is_served_as_it_is(tmp_path):
    assert transformers_model_dir(ModelSource("m", str(tmp_path))) == str(tmp_path)


def test_start_process_adds_env_and_a_peer_without_metrics_has_no_counters(tmp_path):
    """A stand-in server: /health is a file, so it answers 200; /metrics does not exist."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "health").write_text("ok")
    port = free_port()
    script = (
        "import os, sys; open(sys.argv[1], 'w').write(os.environ['SPECSERVE_TEST_ENV']); "
        "import runpy; sys.argv = ['http.server', '--bind', '127.0.0.1', '--directory', sys.argv[2], sys.argv[3]]; "
        "runpy.run_module('http.server', run_name='__main__')"
    )
    command = [sys.executable, "-c", script, str(tmp_path / "env"), str(root), str(port)]
    server = start_process(command, port, tmp_path, deadline_s=30, env={"SPECSERVE_TEST_ENV": "seen"})
    try:
        assert (tmp_path / "env").read_text() == "seen"
        assert scrape_spec_counters(server) is None
    finally:
        stop_server(server)
    assert server.process.poll() is not None


@pytest.mark.parametrize("fraction, expected", [(0.5, 2.0), (0.99, 4.0), (0.0, 1.0)])
def test_percentile_is_nearest_rank(fraction, expected):
    from bench.concurrency import percentile

    assert percentile([1.0, 2.0, 3.0, 4.0], fraction) == expected


def test_a_gguf_is_dequantized_once_per_file_version(tmp_path, monkeypatch):
    import engine.model.gguf_cache as gguf_cache

    gguf = tmp_path / "models" / "tiny.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF v1")
    calls = []

    def fake_save(source, directory):
        calls.append(source.gguf_file)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_cache, "save_dequantized", fake_save)
    source = ModelSource("tiny", str(gguf.parent), gguf.name)
    first = transformers_model_dir(source, tmp_path / "cache")
    assert (
        first == str(tmp_path / "cache" / "tiny.Q4_1") and (tmp_path / "cache" / "tiny.Q4_1" / "config.json").is_file()
    )
    assert transformers_model_dir(source, tmp_path / "cache") == first and len(calls) == 1
    gguf.write_bytes(b"GGUF v2, another size")
    assert transformers_model_dir(source, tmp_path / "cache") == first and len(calls) == 2
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tiny.Q4_1"]


def test_level_order_reverses_at_every_other_level():
    assert [level_order(3, i) for i in range(3)] == [[0, 1, 2], [2, 1, 0], [0, 1, 2]]
    assert level_order(1, 1) == [0]


def test_drive_levels_interleaves_servers_and_writes_after_each_level():
    calls, written, levels = [], [], [1, 4, 16]

    def measure(index: int, level_index: int) -> dict:
        calls.append((index, levels[level_index]))
        return {"concurrency": levels[level_index], "index": index}

    rows = drive_levels(3, levels, measure, lambda rows_so_far: written.append(list(rows_so_far)))
    assert calls == [(0, 1), (1, 1), (2, 1), (2, 4), (1, 4), (0, 4), (0, 16), (1, 16), (2, 16)]
    assert [(r["concurrency"], r["index"]) for r in rows] == [(c, i) for c in (1, 4, 16) for i in range(3)]
    assert {r["round"] for r in rows} == {0}
    assert [len(w) for w in written] == [3, 6, 9] and written[-1] == rows
    times = {(r["index"], r["concurrency"]): r["measured_at_s"] for r in rows}
    in_measuring_order = [times[call] for call in calls]
    assert in_measuring_order == sorted(in_measuring_order) and in_measuring_order[0] >= 0


def test_drive_levels_keeps_finished_levels_when_a_later_one_fails():
    written = []

    def measure(index: int, level_index: int) -> dict:
        if level_index == 1 and index == 0:
            raise RuntimeError("server died")
        return {"concurrency": [1, 4][level_index], "index": index}

    with pytest.raises(RuntimeError, match="server died"):
        drive_levels(2, [1, 4], measure, lambda rows_so_far: written.append(list(rows_so_far)))
    assert [[(r["concurrency"], r["index"]) for r in w] for w in written] == [[(1, 0), (1, 1)]]


def test_a_level_named_again_is_a_round_in_the_other_order():
    calls = []

    def measure(index: int, level_index: int) -> dict:
        calls.append((index, level_index))
        return {"concurrency": 16, "index": index}

    rows = drive_levels(2, [16, 16, 16], measure, lambda rows_so_far: None)
    assert calls == [(0, 0), (1, 0), (1, 1), (0, 1), (0, 2), (1, 2)]
    assert [(r["round"], r["index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_each_level_sends_the_next_conversations_cycling():
    conversations = list("abcde")
    assert level_batches(conversations, [1, 2, 1], 2) == [["a", "b"], ["c", "d", "e", "a"], ["b", "c"]]


def test_rounds_pool_tokens_over_seconds_and_keep_each_ratio():
    rounds = [(0, "none", 100.0, 10.0), (0, "spectra", 120.0, 10.0), (1, "none", 50.0, 20.0),
              (1, "spectra", 45.0, 20.0)]
    rows = [{**row(16, "specserve", drafter, speed), "seconds": seconds, "round": n}
            for n, drafter, speed, seconds in rounds]
    [ratio] = throughput_ratios(rows)
    # pooled: (1200 + 900) / 30 s over (1000 + 1000) / 30 s
    assert ratio["ratio"] == 1.05 and ratio["ratio_by_round"] == [1.2, 0.9]
    markdown = markdown_report(rows, [ratio], "cmd")
    assert "| 16, round 2 | specserve | none | 50.0 |" in markdown and "| 16 | 1.05 (1.20, 0.90) |" in markdown


def stand_in(tmp_path, name: str) -> ServerUnderTest:
    port = free_port()
    command = [sys.executable, "-c", STAND_IN_SERVER, str(port), str(tmp_path / "requests.log")]
    return ServerUnderTest("stand-in", name, command, port, name)


def answers_health(under_test: ServerUnderTest) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{under_test.port}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_measure_servers_starts_all_up_front_and_drives_them_level_by_level(tmp_path):
    servers = [stand_in(tmp_path, "a"), stand_in(tmp_path, "b")]
    conversations = [[{"role": "user", "content": "hi"}]]
    up_after_level = []
    rows = measure_servers(servers, conversations, [1, 2], 1, 4, tmp_path,
                           lambda rows_so_far: up_after_level.append([answers_health(s) for s in servers]))
    # Warm-ups, then level 1 as given (a, b), then level 2 reversed (b b, a a): one server under load at a time.
    assert (tmp_path / "requests.log").read_text().split() == ["a", "b", "a", "b", "b", "b", "a", "a"]
    assert [(r["concurrency"], r["drafter"], r["num_requests"], r["completion_tokens"]) for r in rows] == [
        (1, "a", 1, 2), (1, "b", 1, 2), (2, "a", 2, 4), (2, "b", 2, 4)]
    assert all(r["mean_acceptance_length"] is None for r in rows)  # no /metrics
    assert up_after_level == [[True, True], [True, True]]
    assert not any(answers_health(s) for s in servers)


def test_warm_prompts_caches_every_conversation_first_and_fresh_sessions_name_one_per_request(tmp_path):
    servers = [stand_in(tmp_path, "a")]
    servers[0].fresh_sessions = True
    conversations = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "ho"}]]
    measure_servers(servers, conversations, [2], 1, 4, tmp_path, lambda rows: None, warm_prompts=True)
    log = tmp_path / "requests.log"
    assert log.read_text().split() == ["a"] * 4  # two warm-up requests, then the level's two
    assert (tmp_path / "requests.log.max_tokens").read_text().split() == ["1", "1", "4", "4"]
    sessions = (tmp_path / "requests.log.sessions").read_text().split()
    assert len(set(sessions)) == 4 and all(s.startswith("bench-") for s in sessions)  # never a session resumed


def test_texts_to_continue_go_to_the_completions_endpoint(tmp_path):
    """--completions (a base model): each "conversation" is a text, sent as a prompt to /v1/completions."""
    measure_servers([stand_in(tmp_path, "a")], ["def f():", "def g():"], [2], 1, 4, tmp_path, lambda rows: None)
    paths = (tmp_path / "requests.log.paths").read_text().split()
    assert len(paths) == 3 and all(path.endswith("/v1/completions") for path in paths)


def test_llama_server_runs_the_same_gguf_plain_or_with_its_ngram_speculation(tmp_path):
    from bench.llama_server import SPECULATION_FLAGS, llama_server_command

    plain = llama_server_command(tmp_path / "llama-server", "/models/m.gguf", 8123, 16, False, 2)
    speculative = llama_server_command(tmp_path / "llama-server", "/models/m.gguf", 8123, 16, True, 2)
    assert plain[plain.index("--parallel") + 1] == "16" and plain[plain.index("--model") + 1] == "/models/m.gguf"
    assert int(plain[plain.index("--ctx-size") + 1]) >= 16 * 2048 and "--spec-type" not in plain
    assert speculative == plain + list(SPECULATION_FLAGS) and "ngram-map-k" in SPECULATION_FLAGS


def test_measure_servers_stops_every_server_on_error(tmp_path):
    servers = [stand_in(tmp_path, "a"), stand_in(tmp_path, "b")]

    def fail(rows_so_far):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        measure_servers(servers, [[{"role": "user", "content": "hi"}]], [1], 1, 4, tmp_path, fail)
    assert not any(answers_health(s) for s in servers)


def test_a_server_that_fails_to_start_stops_those_already_up(tmp_path):
    broken = ServerUnderTest("stand-in", "broken", [sys.executable, "-c", "raise SystemExit(3)"], free_port(), "m")
    servers = [stand_in(tmp_path, "a"), broken]
    with pytest.raises(RuntimeError, match="exited with 3"):
        measure_servers(servers, [[{"role": "user", "content": "hi"}]], [1], 1, 4, tmp_path, lambda rows: None)
    assert not answers_health(servers[0])
