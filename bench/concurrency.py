"""Concurrency benchmark: C clients at once replay MT-Redundant turn 2 against a live HTTP server.

Turn-1 answers are produced once, greedily, by the in-process baseline engine and put into every turn-2 history, so
the measured phase holds turn 2 alone. All servers under test (specserve per drafter, and peers such as `transformers
serve --continuous-batching`) are started on loopback up front and warmed up with one short request each. Then the
levels are interleaved: at each concurrency level the servers are driven one after another, the others idle, in an
order reversed at every other level, so a level's ratios compare measurements minutes apart, not the tens of minutes
over which a shared machine's speed drifts. Each level sends the next conversations of the set (cycling), the same
ones to every server, so that what a server learns from traffic (SPECTRA's traffic index) is not the answer to a
later level's questions. A level named more than once is measured again, a round each, and its ratios pool the rounds
(tokens over seconds): on a shared 2-core host one pair of runs swings by ±10 %, and rounds in reversed orders cancel
drift. All servers are stopped at the end, also on error. Throughput is turn-2 tokens over the level's wall time.

`transformers serve` cannot batch a GGUF checkpoint (its model manager reads `config.architectures`, which GGUF
configs leave empty), so a GGUF model is served from the engine's dequantized checkpoint of it
(engine/model/gguf_cache.py), which sets it. Its paged KV cache is sized to the workload: left to itself on CPU it
takes 90 % of the free RAM. This module is an HTTP client (bench/sessions.py builds on it): torch and
the engine are imported only inside the functions that need them.
"""
from __future__ import annotations

import asyncio
import json
import math
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.server_process import RunningServer, free_port, specserve_command, start_process, stop_server
from bench.sse_client import chat_body, completion_body, stream_chat
from engine.model.gguf_cache import dequantized_dir
from engine.model.model_source import ModelSource, resolve_model_source

SPEC_COUNTERS = {
    "drafts": "specserve:spec_decode_num_drafts_total",
    "accepted": "specserve:spec_decode_num_accepted_tokens_total",
    "offered": "specserve:spec_decode_num_offered_tokens_total",
    "verified": "specserve:spec_decode_num_verified_tokens_total",
    "steps": "specserve:engine_step_seconds_count",
    "step_seconds": "specserve:engine_step_seconds_sum",
}
# The peer runs with no hub: everything it loads is local, and the CLI's PyPI update check is off.
PEER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1"}
PEER_PAGE_SIZE = 256  # tokens per KV block of transformers' continuous batching (ContinuousBatchingConfig.page_size)
PEER_MIN_BLOCKS = 16  # headroom for small runs (12 MB a block for SmolLM2-135M in float32)
# specserve's default per-step token budget (SchedulerConfig.max_num_batched_tokens)
DEFAULT_PEER_MAX_BATCH_TOKENS = 512
WARMUP_MAX_TOKENS = 8
WORKLOADS = ("MT-Redundant turn 2", "HumanEval completions through /v1/completions")  # chat, text prompts
ORDER = "interleaved by level"  # results.json setup["order"]
ORDER_NOTE = ("All servers up at once; at each level they are driven one after another (the others idle), "
              "in an order reversed at every other level, each level on the next conversations; a level measured "
              "in several rounds has its ratios pooled over them; `measured_at_s` in results.json says when each "
              "row was taken.")


@dataclass
class ServerUnderTest:
    server: str  # "specserve" or a peer's name
    drafter: str
    command: list[str]
    port: int
    model: str  # the `model` field its requests carry
    env: dict[str, str] = field(default_factory=dict)  # added to the environment it starts in
    fresh_sessions: bool = False  # each request names a session of its own: prompt KV reused, no drafter state resumed


@dataclass
class RequestTiming:
    ttft_s: float
    itl_s: float  # mean seconds between output tokens after the first
    completion_tokens: int


def specserve_under_test(
    drafter: str, engine_flags: list[str], model: str, fresh_sessions: bool = False
) -> ServerUnderTest:
    port = free_port()
    command = specserve_command(port, "--drafter", drafter, *engine_flags)
    return ServerUnderTest("specserve", drafter, command, port, model, fresh_sessions=fresh_sessions)


def llama_server_under_test(gguf_path: str, speculative: bool, parallel: int, threads: int) -> ServerUnderTest:
    """llama-server with PARALLEL slots, plain or with its own n-gram speculation (bench/llama_server.py)."""
    from bench.llama_server import NAMES, llama_server_binary, llama_server_command  # local: pulls torch, the engine

    port = free_port()
    command = llama_server_command(llama_server_binary(), gguf_path, port, parallel, speculative, threads)
    return ServerUnderTest(NAMES[speculative], "ngram-map-k" if speculative else "none", command, port, "default")


def transformers_serve_under_test(
    model_dir: str, device: str, dtype: str, num_blocks: int, max_batch_tokens: int
) -> ServerUnderTest:
    """`transformers serve --continuous-batching` pinned to MODEL_DIR, which is also the `model` its requests name."""
    port = free_port()
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", model_dir, "--continuous-batching",
               "--device", device, "--dtype", dtype, "--cb-num-blocks", str(num_blocks),
               "--cb-max-batch-tokens", str(max_batch_tokens), "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning"]
    return ServerUnderTest("transformers-serve", "none", command, port, model_dir, dict(PEER_ENV))


def peer_device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    """The device and dtype specserve's engine picks for the same flags: CUDA when there is one, float32 on CPU."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, dtype


def peer_num_blocks(prompt_lengths: list[int], max_concurrency: int, max_tokens: int) -> int:
    """KV blocks for MAX_CONCURRENCY requests of the longest prompt plus MAX_TOKENS each at once, so the peer never
    preempts."""
    blocks_per_request = math.ceil((max(prompt_lengths) + max_tokens) / PEER_PAGE_SIZE)
    return max(PEER_MIN_BLOCKS, max_concurrency * blocks_per_request + 1)


def prompt_lengths(tokenizer, conversations: list[list[dict]]) -> list[int]:
    lengths = []
    for messages in conversations:
        text = (messages if isinstance(messages, str)
                else tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return lengths


def transformers_model_dir(source: ModelSource, cache_root: Path | None = None) -> str:
    """A model `transformers serve --continuous-batching` can load: SOURCE itself, or its GGUF's dequantized
    checkpoint."""
    if source.gguf_file is None:
        return source.path
    return str(dequantized_dir(source, cache_root))


async def stream_turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict] | str, max_tokens: int,
                      fresh_session: bool = False) -> RequestTiming:
    """One conversation's next turn, or (MESSAGES a text) its completion through /v1/completions."""
    headers = {"X-Session-ID": f"bench-{uuid.uuid4().hex}"} if fresh_session else None
    body = (completion_body(model, messages, max_tokens) if isinstance(messages, str)
            else chat_body(model, messages, max_tokens))
    reply = await stream_chat(client, url, body, headers)
    return RequestTiming(reply.ttft_s, reply.decode_s / max(reply.completion_tokens - 1, 1), reply.completion_tokens)


async def run_level(url: str, model: str, conversations: list[list[dict]], concurrency: int, max_tokens: int,
                    fresh_sessions: bool = False) -> tuple[list[RequestTiming], float]:
    """All conversations through `concurrency` clients; returns their timings and the wall seconds."""
    queue: asyncio.Queue = asyncio.Queue()
    for messages in conversations:
        queue.put_nowait(messages)
    timings: list[RequestTiming] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            timings.append(await stream_turn(client, url, model, queue.get_nowait(), max_tokens, fresh_sessions))

    start = time.perf_counter()
    # A connection per request: llama-server may close a kept-alive connection under the client's next request
    # ("Server disconnected without sending a response"); loopback connections cost every server the same little.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return timings, time.perf_counter() - start


def scrape_spec_counters(server: RunningServer) -> dict[str, float] | None:
    """Sums of specserve's speculative counters (zero where none was counted yet); None for a server without
    /metrics."""
    try:
        response = httpx.get(server.base_url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200 or not response.headers.get("content-type", "").startswith("text/plain"):
        return None
    wanted = {name: key for key, name in SPEC_COUNTERS.items()}
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[wanted[sample.name]] += sample.value
    return totals


def counter_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {key: after[key] - before[key] for key in after}


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(fraction * len(sorted_values)) - 1)]


def summary_row(
    under_test: ServerUnderTest, concurrency: int, timings: list[RequestTiming], seconds: float, spec: dict | None
) -> dict:
    """One results.json summary row; the speculative columns are null for a server that reports no speculation."""
    ttfts = sorted(t.ttft_s for t in timings)
    tokens = sum(t.completion_tokens for t in timings)
    if spec is None:
        acceptance = drafted = verified = step_ms = busy = None
    else:  # no drafts at all (drafter none): every step yields one token
        acceptance = round(1 + spec["accepted"] / spec["drafts"], 3) if spec["drafts"] else 1.0
        drafted, verified = int(spec["offered"]), int(spec["verified"])
        step_ms = round(1000 * spec["step_seconds"] / spec["steps"], 3) if spec["steps"] else None
        busy = round(spec["step_seconds"] / seconds, 3)
    return {
        "concurrency": concurrency, "server": under_test.server, "drafter": under_test.drafter,
        "num_requests": len(timings), "completion_tokens": tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 3),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 4),
        "itl_p50_s": round(statistics.median(t.itl_s for t in timings), 5),
        "mean_acceptance_length": acceptance,
        "drafted_tokens": drafted,
        "verified_draft_tokens": verified,
        "engine_step_ms": step_ms,  # the engine's mean step, and the share of the level's wall time it stepped:
        "engine_busy_fraction": busy,  # well under 1 where the server, not the engine, bounds the throughput
    }


def start_warm_server(under_test: ServerUnderTest, conversations: list[list[dict]], log_dir: Path, stack: ExitStack,
                      warm_prompts: bool = False) -> RunningServer:
    """UNDER_TEST started (STACK stops it), then untimed requests: one, so lazy start-up work (KV pool, first forwards)
    stays out of level 1; or, with WARM_PROMPTS, every conversation once with one new token, so each server has every
    prompt cached before the first level (specserve in its session cache, llama-server in its prompt cache)."""
    started = time.perf_counter()
    server = start_process(under_test.command, under_test.port, log_dir, env=under_test.env)
    stack.callback(stop_server, server)
    print(f"{under_test.server}/{under_test.drafter} healthy after {time.perf_counter() - started:.1f} s", flush=True)
    warm_up = conversations if warm_prompts else conversations[:1]
    max_tokens = 1 if warm_prompts else WARMUP_MAX_TOKENS
    asyncio.run(run_level(server.api_url, under_test.model, warm_up, 1, max_tokens, under_test.fresh_sessions))
    return server


@contextmanager
def running_servers(servers: list[ServerUnderTest], conversations: list[list[dict]], log_dir: Path,
                    warm_prompts: bool = False) -> Iterator[list[RunningServer]]:
    """All SERVERS started and warmed up, one after another; all stopped on leaving, also on error."""
    with ExitStack() as stack:
        yield [start_warm_server(under_test, conversations, log_dir, stack, warm_prompts) for under_test in servers]


def level_order(num_servers: int, level_index: int) -> list[int]:
    """Server indices in the order they are driven at the LEVEL_INDEX-th level: as given, reversed at every other
    level."""
    order = list(range(num_servers))
    return order if level_index % 2 == 0 else order[::-1]


def level_batches(conversations: list, levels: list[int], requests_per_client: int) -> list[list]:
    """Per level, the conversations its clients send: the next CONCURRENCY * REQUESTS_PER_CLIENT of the set, cycling."""
    batches, start = [], 0
    for concurrency in levels:
        size = concurrency * requests_per_client
        batches.append([conversations[(start + i) % len(conversations)] for i in range(size)])
        start += size
    return batches


def measure_level(under_test: ServerUnderTest, server: RunningServer, batch: list[list[dict]], concurrency: int,
                  max_tokens: int) -> dict:
    """One summary row: BATCH through CONCURRENCY clients against SERVER, with its speculative counters over the
    level."""
    before = scrape_spec_counters(server)
    timings, seconds = asyncio.run(
        run_level(server.api_url, under_test.model, batch, concurrency, max_tokens, under_test.fresh_sessions)
    )
    return summary_row(under_test, concurrency, timings, seconds, counter_delta(before, scrape_spec_counters(server)))


def drive_levels(num_servers: int, levels: list[int], measure: Callable[[int, int], dict],
                 after_level: Callable[[list[dict]], None]) -> list[dict]:
    """Each level, every server in level_order via MEASURE(server index, level index); rows kept in server order per
    level.

    Each row gets `round` (earlier levels of the same concurrency) and `measured_at_s`, seconds from the first
    measurement's start to its own; AFTER_LEVEL gets the rows so far.
    """
    rows: list[dict] = []
    start = time.perf_counter()  # seconds
    for level_index, concurrency in enumerate(levels):
        level_rows = {}
        extra = {"round": levels[:level_index].count(concurrency)}
        for index in level_order(num_servers, level_index):
            extra["measured_at_s"] = round(time.perf_counter() - start, 1)
            level_rows[index] = {**measure(index, level_index), **extra}
            print(json.dumps(level_rows[index]), flush=True)
        rows += [level_rows[index] for index in range(num_servers)]
        after_level(rows)
    return rows


def measure_servers(servers: list[ServerUnderTest], conversations: list[list[dict]], levels: list[int],
                    requests_per_client: int, max_tokens: int, log_dir: Path,
                    after_level: Callable[[list[dict]], None], warm_prompts: bool = False) -> list[dict]:
    """All SERVERS up at once, driven level by level (drive_levels), and stopped at the end."""
    batches = level_batches(conversations, levels, requests_per_client)
    with running_servers(servers, conversations, log_dir, warm_prompts) as running:
        def measure(index: int, level_index: int) -> dict:
            return measure_level(servers[index], running[index], batches[level_index], levels[level_index],
                                 max_tokens)

        return drive_levels(len(servers), levels, measure, after_level)


def throughput_ratios(rows: list[dict]) -> list[dict]:
    """Per concurrency: each specserve drafter over specserve `none`, and each specserve drafter over each peer; a
    level measured in rounds pools them (tokens over seconds) and lists each round's ratio too."""
    speed = pooled_speeds(rows)
    drafters = list(dict.fromkeys(r["drafter"] for r in rows if r["server"] == "specserve"))
    peers = list(dict.fromkeys((r["server"], r["drafter"]) for r in rows if r["server"] != "specserve"))
    pairs = [(("specserve", d), ("specserve", "none")) for d in drafters if d != "none"]
    pairs += [(("specserve", d), peer) for peer in peers for d in drafters]
    ratios = []
    for concurrency in dict.fromkeys(r["concurrency"] for r in rows):
        for top, bottom in pairs:
            a, b = speed.get((concurrency, *top)), speed.get((concurrency, *bottom))
            if a is not None and b:
                ratio = {"concurrency": concurrency, "numerator": "/".join(top), "denominator": "/".join(bottom),
                         "ratio": round(a / b, 3)}
                by_round = round_ratios(rows, concurrency, top, bottom)
                ratios.append({**ratio, "ratio_by_round": by_round} if len(by_round) > 1 else ratio)
    return ratios


def pooled_speeds(rows: list[dict]) -> dict[tuple, float]:
    """(concurrency, server, drafter) -> tokens per second over all its rounds."""
    tokens, seconds = {}, {}
    for r in rows:
        key = (r["concurrency"], r["server"], r["drafter"])
        tokens[key] = tokens.get(key, 0.0) + r["tokens_per_s"] * r["seconds"]
        seconds[key] = seconds.get(key, 0.0) + r["seconds"]
    return {key: tokens[key] / seconds[key] for key in tokens if seconds[key]}


def round_ratios(rows: list[dict], concurrency: int, top: tuple, bottom: tuple) -> list[float]:
    """TOP's speed over BOTTOM's in each round of the level, in round order."""
    speed = {(r.get("round", 0), r["server"], r["drafter"]): r["tokens_per_s"] for r in rows
             if r["concurrency"] == concurrency}
    rounds = sorted({key[0] for key in speed})
    return [round(speed[(n, *top)] / speed[(n, *bottom)], 3) for n in rounds
            if speed.get((n, *top)) is not None and speed.get((n, *bottom))]


def _cell(value, spec: str = "") -> str:
    return "–" if value is None else format(value, spec)


def markdown_report(rows: list[dict], ratios: list[dict], command: str, workload: str = WORKLOADS[0]) -> str:
    lines = [f"# Concurrency, {workload}", "", ORDER_NOTE, "", f"Command: `{command}`", "",
             "| concurrency | server | drafter | tok/s | TTFT p50 s | TTFT p99 s | ITL p50 s "
             "| τ | drafted | verified | engine step ms | engine busy |",
             "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {_level(r)} | {r['server']} | {r['drafter']} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['itl_p50_s']:.3f} | "
                     f"{_cell(r['mean_acceptance_length'], '.2f')} | {_cell(r['drafted_tokens'])} | "
                     f"{_cell(r['verified_draft_tokens'])} | {_cell(r.get('engine_step_ms'), '.2f')} | "
                     f"{_cell(r.get('engine_busy_fraction'), '.0%')} |")
    columns = list(dict.fromkeys(f"{q['numerator']} ÷ {q['denominator']}" for q in ratios))
    if columns:
        cells = {(q["concurrency"], f"{q['numerator']} ÷ {q['denominator']}"): _ratio_cell(q) for q in ratios}
        lines += ["", "Throughput ratios (tok/s over tok/s; over rounds pooled, each round's in brackets):", "",
                  "| concurrency | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
        for concurrency in dict.fromkeys(q["concurrency"] for q in ratios):
            lines.append(f"| {concurrency} | "
                         + " | ".join(cells.get((concurrency, c), "–") for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _level(row: dict) -> str:
    return f"{row['concurrency']}" + (f", round {row['round'] + 1}" if row.get("round") else "")


def _ratio_cell(ratio: dict) -> str:
    rounds = ratio.get("ratio_by_round")
    return f"{ratio['ratio']:.2f}" + (f" ({', '.join(f'{r:.2f}' for r in rounds)})" if rounds else "")


def write_concurrency_results(rows: list[dict], command: str, out_dir: Path, setup: dict | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ratios = throughput_ratios(rows)
    results = {"benchmark": "concurrency", "command": command, **({"setup": setup} if setup else {}),
               "summary": rows, "ratios": ratios}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    workload = (setup or {}).get("workload", WORKLOADS[0])
    (out_dir / "results.md").write_text(markdown_report(rows, ratios, command, workload))
    _plot_throughput(rows, out_dir / "throughput.png")


def _plot_throughput(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    levels = sorted({r["concurrency"] for r in rows})
    speed = pooled_speeds(rows)
    for key in dict.fromkeys((r["server"], r["drafter"]) for r in rows):
        points = [(c, speed[(c, *key)]) for c in levels if (c, *key) in speed]
        ax.plot(*zip(*points), marker="o", label=f"{key[0]} / {key[1]}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("turn-2 tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def turn2_conversations(questions: list[dict], tokenizer, runner, max_tokens: int) -> list[list[dict]]:
    """Turn-2 histories: each question's turn 1, the baseline's greedy answer to it, and turn 2."""
    from bench.mt import turn_prompts  # local: pulls torch (bench.exactness); this module stays an HTTP client

    conversations = []
    answers = runner.generate_batch([turn_prompts(tokenizer, question, None) for question in questions], max_tokens)
    for question, answer in zip(questions, answers):
        conversations.append([
            {"role": "user", "content": question["turns"][0]},
            {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
            {"role": "user", "content": question["turns"][1]},
        ])
    return conversations


def peers_under_test(args, conversations: list[list[dict]], tokenizer) -> tuple[list[ServerUnderTest], dict]:
    """The peer servers ARGS ask for, and how they were set up (for results.json)."""
    peers, setup = [], {}
    if "transformers-serve" in args.peers:
        from transformers.utils.import_utils import is_serve_available

        if not is_serve_available():
            raise SystemExit("transformers serve needs fastapi, uvicorn, pydantic and openai installed "
                             "(or pass --peers '')")
        model_dir = transformers_model_dir(resolve_model_source(args.model))
        device, dtype = peer_device_and_dtype(args.device, args.dtype)
        num_blocks = args.peer_kv_blocks or peer_num_blocks(
            prompt_lengths(tokenizer, conversations), max(args.concurrency), args.max_new_tokens
        )
        # Tokens per forward: specserve's own per-step budget where the flags carry one
        max_batch_tokens = (args.peer_max_batch_tokens or getattr(args, "max_num_batched_tokens", None)
                            or DEFAULT_PEER_MAX_BATCH_TOKENS)
        peer = transformers_serve_under_test(model_dir, device, dtype, num_blocks, max_batch_tokens)
        peers.append(peer)
        shown = ["transformers", *peer.command[3:]]
        shown[shown.index("--port") + 1] = "PORT"
        setup["transformers-serve"] = {"command": shlex.join(shown), "env": peer.env,
                                       "kv_page_size": PEER_PAGE_SIZE, "kv_blocks": num_blocks}
    for speculative in (False, True):
        name = "llama-server-spec" if speculative else "llama-server"
        if name in args.peers:
            peer = llama_server_under_test(
                gguf_of(args.model), speculative, max(args.concurrency), args.num_threads or 2
            )
            peers.append(peer)
            from bench.llama_server import llama_commit  # local: pulls torch and the engine (bench.runners)

            setup[name] = {"command": shlex.join(_shown(peer.command)), "llama_cpp_commit": llama_commit()}
    return peers, setup


def gguf_of(model: str | None) -> str:
    source = resolve_model_source(model)
    if source.gguf_file is None:
        raise SystemExit("llama-server peers need a GGUF model (--model FILE.gguf, or the embedded default)")
    return str(Path(source.path) / source.gguf_file)


def _shown(command: list[str]) -> list[str]:
    """COMMAND as results.json shows it: the port and the machine's paths left out."""
    shown = [Path(command[0]).name, *command[1:]]
    shown[shown.index("--port") + 1] = "PORT"
    shown[shown.index("--model") + 1] = Path(shown[shown.index("--model") + 1]).name
    return shown


def run_concurrency_benchmark(
    args, drafters: list[str], conversations: list[list[dict]], tokenizer, engine_flags: list[str], out_dir: Path,
) -> list[dict]:
    """CONVERSATIONS (turn-2 histories, from turn2_conversations) through every server under test, level by level."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model_source(args.model).name
    servers = [specserve_under_test(d, engine_flags, model, args.warm_prompts) for d in drafters]
    peers, setup = peers_under_test(args, conversations, tokenizer)
    workload = WORKLOADS[isinstance(conversations[0], str)]
    setup.update(specserve_flags=engine_flags, order=ORDER, warm_prompts=args.warm_prompts, workload=workload)
    command = "specserve " + shlex.join(sys.argv[1:])
    return measure_servers(servers + peers, conversations, args.concurrency, args.requests_per_client,
                           args.max_new_tokens, out_dir,
                           lambda rows: write_concurrency_results(rows, command, out_dir, setup), args.warm_prompts)
