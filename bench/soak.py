"""Load you can put numbers on: C streaming clients for a fixed time against a running server.

Each client loops: a chat request with a random prompt, a random `max_tokens` and a random
temperature (greedy one time in four), streamed; a share of them hangs up at a random point
(a client that goes away). Every stream that is not hung up on must end with a
`finish_reason` and `data: [DONE]`; anything else is counted as truncated. Meanwhile the
server's and its engine's resident memory is sampled. After the load, the KV blocks in use
must return to zero and memory to near its baseline.

`tests/reliability/test_load.py` runs a short version in `make test`; `make soak` runs
64 clients for 5 minutes (`specserve bench soak`) and writes bench/results/soak/: results.json,
results.md and memory.png.
"""
from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from bench.server_process import start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ("a lighthouse", "the sea", "a robot that learns to paint", "bread", "a city at night", "prime numbers",
          "an old library", "rain", "a chess game", "the moon")
MEMORY_SAMPLE_S = 1.0


@dataclass
class LoadConfig:
    clients: int
    duration_s: float
    max_tokens: tuple[int, int] = (8, 256)  # drawn uniformly per request
    hang_up_share: float = 0.1  # requests whose client goes away after a random number of chunks
    seed: int = 0


@dataclass
class LoadReport:
    requests: int = 0
    completed: int = 0
    hung_up: int = 0
    truncated: int = 0  # streams that ended without finish_reason and [DONE]
    completion_tokens: int = 0
    errors: Counter = field(default_factory=Counter)  # by kind: "status 429", "error event: ...", exception name
    latencies_s: list[float] = field(default_factory=list)  # end to end, completed streams
    ttfts_s: list[float] = field(default_factory=list)
    memory: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, RSS MiB as resident_mib)

    def summary(self) -> dict:
        return {"requests": self.requests, "completed": self.completed, "hung_up": self.hung_up,
                "truncated": self.truncated, "completion_tokens": self.completion_tokens, "errors": dict(self.errors),
                "latency_p50_s": percentile(self.latencies_s, 50), "latency_p99_s": percentile(self.latencies_s, 99),
                "ttft_p50_s": percentile(self.ttfts_s, 50), "ttft_p99_s": percentile(self.ttfts_s, 99)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))], 3)


POOL_MAPPING_BYTES = 256 * 2**20  # anonymous mappings this large are the KV pool's keys and values (tensors <~120 MB)


def resident_mib(server_pid: int) -> float:
    """RSS of the server process and its children (the engine), MiB, apart from the paged KV pool. The pool is
    mapped once at start-up from pages the OS zeroes as blocks are first written: its RSS grows with the blocks a
    load has touched and never shrinks, which is use of memory already reserved, not a leak."""
    process = psutil.Process(server_pid)
    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_info().rss - _kv_pool_resident_bytes(member)
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def _kv_pool_resident_bytes(process: psutil.Process) -> int:
    """The pool is a shared anonymous mapping, which Linux names after /dev/zero (psutil drops its " (deleted)")."""
    return sum(m.rss for m in process.memory_maps(grouped=False)
               if m.size >= POOL_MAPPING_BYTES and m.path in ("", "[anon]", "/dev/zero"))


def one_request(
    client: httpx.Client, rng: random.Random, config: LoadConfig, report: LoadReport, lock: threading.Lock
) -> None:
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": rng.randint(*config.max_tokens),
            "temperature": 0.0 if rng.random() < 0.25 else rng.uniform(0.3, 1.2),
            "messages": [{"role": "user", "content": f"Write about {rng.choice(TOPICS)} ({rng.randint(0, 10**6)})."}]}
    hang_up_after = rng.randint(1, 20) if rng.random() < config.hang_up_share else None
    start, outcome = time.monotonic(), stream_outcome(client, body, hang_up_after)
    with lock:
        report.requests += 1
        kind, ttft, tokens = outcome
        if kind == "completed":
            report.completed += 1
            report.completion_tokens += tokens
            report.latencies_s.append(time.monotonic() - start)
            report.ttfts_s.append(ttft)
        elif kind == "hung up":
            report.hung_up += 1
        elif kind == "truncated":
            report.truncated += 1
        else:
            report.errors[kind] += 1


def stream_outcome(client: httpx.Client, body: dict, hang_up_after: int | None) -> tuple[str, float | None, int]:
    """("completed" | "hung up" | "truncated" | an error kind, seconds to the first chunk, completion tokens)."""
    start, ttft, chunks, finished, done, tokens = time.monotonic(), None, 0, False, False, 0
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                return f"status {response.status_code}", None, 0
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    return f"error event: {event['error'].get('code') or event['error'].get('type')}", None, 0
                ttft = ttft if ttft is not None else time.monotonic() - start
                chunks += 1
                finished = finished or any(c.get("finish_reason") for c in event.get("choices", []))
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
                if hang_up_after is not None and chunks >= hang_up_after:
                    return "hung up", ttft, 0
    except httpx.HTTPError as exc:
        return type(exc).__name__, None, 0
    return ("completed" if finished and done else "truncated"), ttft, tokens


def client_loop(
    base_url: str, config: LoadConfig, index: int, deadline: float, report: LoadReport, lock: threading.Lock
) -> None:
    rng = random.Random(config.seed * 1000 + index)
    with httpx.Client(base_url=base_url, timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while time.monotonic() < deadline:
            one_request(client, rng, config, report, lock)


def run_load(base_url: str, server_pid: int, config: LoadConfig) -> LoadReport:
    """CONFIG.clients clients for CONFIG.duration_s seconds (requests in flight at the deadline finish)."""
    report, lock = LoadReport(), threading.Lock()
    start = time.monotonic()
    deadline = start + config.duration_s
    threads = [threading.Thread(target=client_loop, args=(base_url, config, i, deadline, report, lock), daemon=True)
               for i in range(config.clients)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        report.memory.append((round(time.monotonic() - start, 1), round(resident_mib(server_pid), 1)))
        time.sleep(MEMORY_SAMPLE_S)  # memory sampling interval while the clients run
    return report


def settle(base_url: str, deadline_s: float = 30.0) -> dict:
    """/health once no request runs or waits (aborted work frees its blocks within a few steps)."""
    end = time.monotonic() + deadline_s
    while True:
        health = httpx.get(base_url + "/health", timeout=5).json()
        if ((health["num_running"], health["num_waiting"], health["kv_cache_usage"]) == (0, 0, 0)
                or time.monotonic() > end):
            return health
        time.sleep(0.2)  # poll interval, bounded by the deadline


def run_soak(args, out_dir: Path) -> dict:
    """`specserve bench soak`: a specserve on loopback (sessions off, so KV must return to zero), the load, a report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    server = start_server(out_dir, "--session-mode", "off", "--max-num-seqs", str(args.soak_clients))
    try:
        baseline = resident_mib(server.process.pid)
        config = LoadConfig(clients=args.soak_clients, duration_s=args.soak_seconds, seed=args.seed)
        report = run_load(server.base_url, server.process.pid, config)
        health = settle(server.base_url)
        time.sleep(2)  # let freed memory show in the RSS
        after = resident_mib(server.process.pid)
    finally:
        stop_server(server)
    results = {"command": "specserve " + " ".join(sys.argv[1:]), "config": asdict(config),
               "summary": report.summary(), "memory_mib": {"baseline": round(baseline, 1), "after": round(after, 1),
               "peak": max(m for _, m in report.memory)}, "health_after": health, "memory_over_time": report.memory}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    plot_memory(report.memory, baseline, out_dir / "memory.png")
    server.log_path.unlink(missing_ok=True)
    return results


def markdown(results: dict) -> str:
    s, m, h = results["summary"], results["memory_mib"], results["health_after"]
    return "\n".join([
        "# Soak: streaming clients against one specserve", "", f"Command: `{results['command']}`", "",
        f"{results['config']['clients']} clients for {results['config']['duration_s']:.0f} s; random max_tokens "
        f"{results['config']['max_tokens']}, temperature 0 (a quarter) or 0.3-1.2, "
        f"{results['config']['hang_up_share']:.0%} of requests hung up after 1-20 chunks.", "",
        "| requests | completed | hung up | truncated | errors | tokens | latency p50 / p99 s | TTFT p50 / p99 s |",
        "|---|---|---|---|---|---|---|---|",
        f"| {s['requests']} | {s['completed']} | {s['hung_up']} | {s['truncated']} | {sum(s['errors'].values())} "
        f"{s['errors'] or ''} | {s['completion_tokens']} | {s['latency_p50_s']} / {s['latency_p99_s']} | "
        f"{s['ttft_p50_s']} / {s['ttft_p99_s']} |", "",
        f"After the load: {h['num_running']} running, {h['num_waiting']} waiting, KV in use "
        f"{h['kv_cache_usage']}, engine restarts {h.get('engine_restarts')}. Memory (server + engine RSS apart from "
        f"the KV pool): baseline {m['baseline']} MiB, peak {m['peak']} MiB, "
        f"after {m['after']} MiB ({(m['after'] / m['baseline'] - 1):+.1%}). "
        "Over time: memory.png.", ""])


def plot_memory(samples: list[tuple[float, float]], baseline: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot([t for t, _ in samples], [m for _, m in samples], label="server + engine RSS apart from the KV pool")
    ax.axhline(baseline, color="grey", linewidth=0.8, label="baseline")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
