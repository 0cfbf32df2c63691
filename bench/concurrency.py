"""Concurrency benchmark: C clients at once replay MT-Redundant turn 2 against a live HTTP server.

Turn-1 answers are produced once, greedily, by the first specserve under test and
put into every turn-2 history, so the measured phase holds turn 2 alone. Each
server (specserve per drafter, and peers such as `transformers serve
--continuous-batching`) is started on loopback, driven at each concurrency level,
and stopped. Throughput is turn-2 tokens over the level's wall time.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.server_process import RunningServer, free_port, specserve_command, start_process, stop_server
from engine.model_source import resolve_model_source

SPEC_COUNTERS = {
    "drafts": "specserve:spec_decode_num_drafts_total",
    "accepted": "specserve:spec_decode_num_accepted_tokens_total",
    "offered": "specserve:spec_decode_num_offered_tokens_total",
    "verified": "specserve:spec_decode_num_verified_tokens_total",
}


@dataclass
class ServerUnderTest:
    server: str  # "specserve" or a peer's name
    drafter: str
    command: list[str]
    port: int
    model: str  # the `model` field its requests carry


@dataclass
class RequestTiming:
    ttft_s: float
    itl_s: float  # mean seconds between output tokens after the first
    completion_tokens: int


def specserve_under_test(drafter: str, engine_flags: list[str], model: str) -> ServerUnderTest:
    port = free_port()
    return ServerUnderTest("specserve", drafter, specserve_command(port, "--drafter", drafter, *engine_flags), port, model)


def transformers_serve_under_test() -> ServerUnderTest:
    source = resolve_model_source(None)
    port = free_port()
    model = f"{source.path}:{source.gguf_file}"
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", model,
               "--continuous-batching", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    return ServerUnderTest("transformers-serve", "none", command, port, model)


async def stream_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int) -> RequestTiming:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    completion_tokens = 0
    async with client.stream("POST", url + "/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    if first is None:
        raise RuntimeError("the server streamed no text")
    return RequestTiming(first - start, (last - first) / max(completion_tokens - 1, 1), completion_tokens)


async def run_level(url: str, model: str, conversations: list[list[dict]], concurrency: int, max_tokens: int) -> tuple[list[RequestTiming], float]:
    """All conversations through `concurrency` clients; returns their timings and the wall seconds."""
    queue: asyncio.Queue = asyncio.Queue()
    for messages in conversations:
        queue.put_nowait(messages)
    timings: list[RequestTiming] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            timings.append(await stream_turn(client, url, model, queue.get_nowait(), max_tokens))

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return timings, time.perf_counter() - start


def scrape_spec_counters(server: RunningServer) -> dict[str, float]:
    """Sums of specserve's speculative counters (empty for servers without them)."""
    try:
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    wanted = {name: key for key, name in SPEC_COUNTERS.items()}
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[wanted[sample.name]] += sample.value
                found = True
    return totals if found else {}


def summary_row(under_test: ServerUnderTest, concurrency: int, timings: list[RequestTiming], seconds: float, spec: dict) -> dict:
    ttfts = sorted(t.ttft_s for t in timings)
    tokens = sum(t.completion_tokens for t in timings)
    return {
        "concurrency": concurrency, "server": under_test.server, "drafter": under_test.drafter,
        "num_requests": len(timings), "completion_tokens": tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 3),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4),
        "itl_p50_s": round(statistics.median(t.itl_s for t in timings), 5),
        "mean_acceptance_length": round(1 + spec["accepted"] / spec["drafts"], 3) if spec.get("drafts") else None,
        "drafted_tokens": int(spec["offered"]) if spec else None,
        "verified_draft_tokens": int(spec["verified"]) if spec else None,
    }


def measure_server(under_test: ServerUnderTest, conversations, levels: list[int], requests_per_client: int, max_tokens: int, log_dir: Path) -> list[dict]:
    server = start_process(under_test.command, under_test.port, log_dir)
    rows = []
    try:
        for concurrency in levels:
            batch = [conversations[i % len(conversations)] for i in range(concurrency * requests_per_client)]
            before = scrape_spec_counters(server)
            timings, seconds = asyncio.run(run_level(server.api_url, under_test.model, batch, concurrency, max_tokens))
            after = scrape_spec_counters(server)
            spec = {k: after[k] - before.get(k, 0.0) for k in after}
            rows.append(summary_row(under_test, concurrency, timings, seconds, spec))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_server(server)
    return rows


def write_concurrency_results(rows: list[dict], command: str, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"benchmark": "concurrency", "command": command, "summary": rows}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    lines = ["| concurrency | server | drafter | tok/s | TTFT p50 s | TTFT p99 s | ITL p50 s | τ | drafted | verified |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['server']} | {r['drafter']} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} | "
                     f"{r['ttft_p99_s']:.2f} | {r['itl_p50_s']:.3f} | {r['mean_acceptance_length'] or '–'} | "
                     f"{r['drafted_tokens'] if r['drafted_tokens'] is not None else '–'} | {r['verified_draft_tokens'] if r['verified_draft_tokens'] is not None else '–'} |")
    (out_dir / "results.md").write_text(f"# Concurrency, MT-Redundant turn 2\n\nCommand: `{command}`\n\n" + "\n".join(lines) + "\n")
    _plot_throughput(rows, out_dir / "throughput.png")


def _plot_throughput(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in dict.fromkeys((r["server"], r["drafter"]) for r in rows):
        points = [(r["concurrency"], r["tokens_per_s"]) for r in rows if (r["server"], r["drafter"]) == key]
        ax.plot(*zip(*points), marker="o", label=f"{key[0]} / {key[1]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("turn-2 tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def turn2_conversations(questions: list[dict], tokenizer, runner, max_tokens: int) -> list[list[dict]]:
    """Turn-2 histories: each question's turn 1, the baseline's greedy answer to it, and turn 2."""
    from bench.mt import turn_prompts

    conversations = []
    for question in questions:
        answer = runner.generate(turn_prompts(tokenizer, question, None), max_tokens).token_ids
        conversations.append([
            {"role": "user", "content": question["turns"][0]},
            {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
            {"role": "user", "content": question["turns"][1]},
        ])
    return conversations


def run_concurrency_benchmark(args, questions: list[dict], tokenizer, baseline_runner, engine_flags: list[str], out_dir: Path) -> list[dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    conversations = turn2_conversations(questions, tokenizer, baseline_runner, args.max_new_tokens)
    model = resolve_model_source(args.model).name
    servers = [specserve_under_test(d, engine_flags, model) for d in args.concurrency_drafters]
    servers += [transformers_serve_under_test() for peer in args.peers if peer == "transformers-serve"]
    command = "specserve " + " ".join(sys.argv[1:])
    rows = []
    for under_test in servers:
        rows += measure_server(under_test, conversations, args.concurrency, args.requests_per_client, args.max_new_tokens, out_dir)
        write_concurrency_results(rows, command, out_dir)
    return rows
