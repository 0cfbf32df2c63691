"""`specserve bench replicas`: specserve replicas behind the Shepherd Model Gateway on loopback, as deployed.

Four runs, servers started one at a time:
1. **one replica** serves C concurrent three-turn conversations (MT-Redundant turns 1 and 2, then THIRD_TURN), half
   naming a session (X-Session-ID), half not: the time to first token a conversation gets where its cache always is;
2. **the router and N replicas** serve the same conversations: per kind, the session hit rate (the replicas' own
   count of later turns continued from their cache, /health), turn-2 and turn-3 time to first token against run 1,
   errors, and the load each replica took (its requests, and the router's own count);
3. **failover**: new conversations; once half of them have had their first answer, one replica is killed (SIGKILL
   to its process group). Reported: the attempts that failed (each client retries a failed turn, RETRIES times),
   how each failed and how long after the kill, how long until the router marks the replica unhealthy, and the hit
   rate of the later turns after the kill (the dead replica's conversations re-home and build their caches again);
4. **back**: the replica is started again; how long until the router sends it traffic, and the share of a further
   set of new conversations it takes.
"""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.data import load_questions
from bench.server_process import RunningServer, free_port, specserve_command, start_process, stop_server
from bench.sse_client import chat_body, stream_chat
from scheduler.sessions import EXPLICIT, IMPLICIT, SESSION_KINDS

THIRD_TURN = "Summarise your last answer in two sentences."
RETRIES = 2  # a failed turn is sent again this many times, RETRY_DELAY_S apart
RETRY_DELAY_S = 0.5
REQUEST_TIMEOUT = httpx.Timeout(600.0, connect=10.0, read=120.0)  # a stream silent for 2 minutes is a hang
POLL_S = 0.1  # how often the router's worker list is read after a kill or a restart
WINDOW_S = 10.0  # the failover's later turns are counted in windows of this many seconds after the kill
# The Shepherd Model Gateway (smg), as docs/deployment.md, docker/compose.replicas.yaml and deploy/k8s/router.yaml run
# it: a conversation naming its session (X-Session-ID) stays on the replica its first turn went to (the gateway's
# routing-key table), and a new name goes to the replica holding the fewest names (min_group: placing names by
# prefix instead piles conversations that share a system prompt onto one replica, and a named conversation cannot
# leave it); one without a name goes where the longest prefix of its text is cached (cache_aware), if at least
# CACHE_THRESHOLD of the request's text is (the gateway's default, 0.3, loses a second turn whose answer is long
# beside its first prompt: bench routing-sim), else to the replica with the least cached text; a matched replica more
# loaded than the fleet's mean by the gateway's spill gate (its defaults: 1.5 times the mean and a margin) passes the
# request to the least loaded one. Health checked every second, one failure marks a replica unhealthy and one success
# healthy again.
CACHE_THRESHOLD = 0.1
ROUTER_VERSION = "smg 1.13.0"
ROUTER_FLAGS = ("--policy", "cache_aware", "--cache-threshold", str(CACHE_THRESHOLD),
                "--routing-key-override", "--routing-key-headers", "x-session-id", "--assignment-mode", "min_group",
                "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--health-success-threshold", "1", "--disable-tokenizer-autoload")


@dataclass
class Conversation:
    tag: str  # the run's name and the conversation's number: its system message, so every conversation differs
    turns: list[str]
    session_id: str | None  # named conversations send it as X-Session-ID and as session_id (session_naming)

    @property
    def kind(self) -> str:
        return EXPLICIT if self.session_id else IMPLICIT


@dataclass
class TurnRecord:
    tag: str
    kind: str
    turn: int  # 1, 2 or 3
    started_s: float  # since the run began
    ttft_s: float | None = None  # of the attempt that succeeded
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    errors: list[tuple[float, str]] = field(default_factory=list)  # (seconds since the run began, what the client saw)


def conversations_for(questions: list[dict], count: int, run: str) -> list[Conversation]:
    return [Conversation(f"{run}-{i}", [*questions[i % len(questions)]["turns"][:2], THIRD_TURN],
                         f"{run}-{i}" if i % 2 == 0 else None) for i in range(count)]


def session_naming(session_id: str | None) -> tuple[dict, dict]:
    """The headers and body fields that name SESSION_ID behind the gateway: X-Session-ID places the conversation (the
    gateway reads headers), session_id names it to the replica (the gateway forwards bodies but not that header)."""
    return ({"X-Session-ID": session_id}, {"session_id": session_id}) if session_id else ({}, {})


async def replay(client: httpx.AsyncClient, url: str, model: str, conversation: Conversation, max_tokens: int,
                 start: float, records: list[TurnRecord], progress: dict) -> None:
    """The conversation's turns in order, each retried on failure; the history is what the client received."""
    messages = [{"role": "system", "content": f"You are a helpful assistant. Conversation {conversation.tag}."}]
    headers, name = session_naming(conversation.session_id)
    for turn, text in enumerate(conversation.turns, 1):
        messages.append({"role": "user", "content": text})
        record = TurnRecord(conversation.tag, conversation.kind, turn, time.monotonic() - start)
        records.append(record)
        for attempt in range(RETRIES + 1):
            try:
                reply = await stream_chat(client, url, {**chat_body(model, messages, max_tokens), **name}, headers)
            except (httpx.HTTPError, RuntimeError) as error:
                record.errors.append((round(time.monotonic() - start, 3), f"{type(error).__name__}: {error}"[:300]))
                if attempt == RETRIES:
                    return
                await asyncio.sleep(RETRY_DELAY_S)
                continue
            record.ttft_s, record.prompt_tokens, record.cached_tokens = (reply.ttft_s, reply.prompt_tokens,
                                                                          reply.cached_tokens)
            record.completion_tokens = reply.completion_tokens
            messages.append({"role": "assistant", "content": reply.text})
            progress[turn] = progress.get(turn, 0) + 1
            break


async def replay_all(url: str, conversations: list[Conversation], max_tokens: int, during=None) -> dict:
    """Every conversation at once; DURING(start, progress), if given, runs beside them (the failover's kill)."""
    records: list[TurnRecord] = []
    progress: dict[int, int] = {}
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=httpx.Limits(max_connections=None)) as client:
        model = (await client.get(url + "/models")).json()["data"][0]["id"]
        jobs = [replay(client, url, model, c, max_tokens, start, records, progress) for c in conversations]
        side = [during(start, progress)] if during else []
        results = await asyncio.gather(*jobs, *side)
    return {"records": records, "seconds": time.monotonic() - start, "during": results[-1] if during else None}


# --- the replicas' and the router's own figures ----------------------------------------------------------------------
def replica_counts(replica: RunningServer) -> dict:
    """The replica's later turns continued from its cache and not (/health), and its finished requests (/metrics)."""
    health = httpx.get(replica.base_url + "/health", timeout=10).json()
    families = text_string_to_metric_families(httpx.get(replica.base_url + "/metrics", timeout=10).text)
    finished = sum(s.value for f in families for s in f.samples if s.name == "specserve:request_success_total")
    return {"hits": health["session_hits"], "misses": health["session_misses"], "requests": int(finished)}


def counts_between(before: dict, after: dict) -> dict:
    return {"hits": {k: after["hits"][k] - before["hits"][k] for k in SESSION_KINDS},
            "misses": {k: after["misses"][k] - before["misses"][k] for k in SESSION_KINDS},
            "requests": after["requests"] - before["requests"]}


def router_workers(router_url: str, api_key: str | None = None) -> dict[str, bool]:
    """The router's replicas and whether it counts each healthy (its /workers, behind its API key where it has one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return {w["url"]: w["is_healthy"]
            for w in httpx.get(router_url + "/workers", headers=headers, timeout=5).json()["workers"]}


def router_processed(metrics_url: str) -> dict[str, int]:
    families = text_string_to_metric_families(httpx.get(metrics_url, timeout=5).text)
    return {s.labels["worker"]: int(s.value) for f in families for s in f.samples
            if s.name == "smg_worker_requests_total"}


def hit_rates(deltas: list[dict]) -> dict[str, dict]:
    by_kind = {}
    for kind in SESSION_KINDS:
        hits, misses = sum(d["hits"][kind] for d in deltas), sum(d["misses"][kind] for d in deltas)
        by_kind[kind] = {"hits": hits, "misses": misses, "hit_rate": round(hits / (hits + misses), 3)
                         if hits + misses else None}
    return by_kind


def served_from_cache(record: TurnRecord) -> bool:
    """A later turn the client saw served from a session cache: at least half its prompt's KV was cached (a miss
    finds at most a block or two of the system message another conversation shares)."""
    return record.cached_tokens >= record.prompt_tokens / 2


def hits_by_window(records: list[TurnRecord], killed_at: float) -> list[dict]:
    """The client's hit rate (served_from_cache) of later turns: those started before the kill, then those started in
    each WINDOW_S after it."""
    later = [r for r in records if r.turn > 1 and r.ttft_s is not None]

    def row(label: str, chosen: list[TurnRecord]) -> dict:
        hits = sum(served_from_cache(r) for r in chosen)
        return {"window": label, "turns": len(chosen), "hit_rate": round(hits / len(chosen), 3) if chosen else None}

    rows = [row("before the kill", [r for r in later if r.started_s < killed_at])]
    after = [r.started_s - killed_at for r in later if r.started_s >= killed_at]
    for k in range(int(max(after, default=-1) // WINDOW_S) + 1):
        chosen = [r for r in later if k * WINDOW_S <= r.started_s - killed_at < (k + 1) * WINDOW_S]
        rows.append(row(f"{k * WINDOW_S:.0f}-{(k + 1) * WINDOW_S:.0f} s after", chosen))
    return rows


def turn_summary(records: list[TurnRecord]) -> dict:
    """Per kind and turn: p50 and p90 time to first token (p90: the lower of its two nearest ranks, numpy's
    'lower'), failed attempts, turns that never succeeded."""
    summary = {}
    for kind in SESSION_KINDS:
        for turn in (1, 2, 3):
            chosen = [r for r in records if r.kind == kind and r.turn == turn]
            ttfts = sorted(r.ttft_s for r in chosen if r.ttft_s is not None)
            summary[f"{kind} turn {turn}"] = {
                "turns": len(chosen), "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
                "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 3) if ttfts else None,
                "failed_attempts": sum(len(r.errors) for r in chosen),
                "unanswered": sum(r.ttft_s is None for r in chosen),
            }
    return summary


# --- processes -------------------------------------------------------------------------------------------------------
def router_command() -> list[str]:
    """The gateway's launcher: `smg launch` from this interpreter's environment (the `router` extra) or PATH."""
    found = shutil.which("smg", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    if found is None:
        raise SystemExit("no smg: install it with `pip install -e '.[router]'` (make test installs it)")
    return [found, "launch"]


def start_replica(log_dir: Path, port: int, args, threads: int | None = None) -> RunningServer:
    threads_flags = ("--num-threads", str(threads)) if threads else ()
    return start_process(specserve_command(port, "--kv-cache-memory", str(args.replica_kv_gib), *threads_flags),
                         port, log_dir)


def threads_per_replica(args) -> int:
    """The machine's cores shared out: replicas on one machine each get their part, as on their own hardware."""
    return args.replica_threads or max(1, (os.cpu_count() or 1) // args.replicas)


def start_router(log_dir: Path, replicas: list[RunningServer], api_key: str | None = None) -> tuple[RunningServer, str]:
    """The router on loopback in front of REPLICAS (API_KEY: what it asks of clients and sends the replicas), once it
    routes to all of them; returns it and its metrics URL."""
    port, metrics_port = free_port(), free_port()
    command = [*router_command(), "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(metrics_port), "--worker-urls", *[r.base_url for r in replicas], *ROUTER_FLAGS,
               *(("--api-key", api_key) if api_key else ())]
    router = start_process(command, port, log_dir)
    wait_until_routed(router.base_url, [r.base_url for r in replicas], api_key)
    return router, f"http://127.0.0.1:{metrics_port}/metrics"


def wait_until_routed(router_url: str, workers: list[str], api_key: str | None = None, limit_s: float = 120.0) -> None:
    """Block until the router reports every one of WORKERS healthy: it listens before it has registered them (in the
    background), and a request sent meanwhile is answered 404 (no worker serves the model)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        healthy = router_workers(router_url, api_key)
        if all(healthy.get(worker) for worker in workers):
            return
        time.sleep(POLL_S)
    raise TimeoutError(f"the router did not report {len(workers)} healthy workers in {limit_s} s")


def kill_group(server: RunningServer) -> None:
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


async def wait_for_worker(router_url: str, worker: str, healthy: bool, since: float, limit_s: float = 120.0) -> float:
    """Seconds from SINCE until the router reports WORKER healthy (or unhealthy)."""
    while time.monotonic() - since < limit_s:
        if router_workers(router_url).get(worker) == healthy:
            return round(time.monotonic() - since, 3)
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"the router did not mark {worker} {'healthy' if healthy else 'unhealthy'} in {limit_s} s")


# --- the runs --------------------------------------------------------------------------------------------------------
def run_single(args, conversations, out_dir: Path) -> dict:
    replica = start_replica(out_dir, free_port(), args)  # all of the machine's cores
    try:
        before = replica_counts(replica)
        run = asyncio.run(replay_all(replica.api_url, conversations, args.max_new_tokens))
        deltas = [counts_between(before, replica_counts(replica))]
    finally:
        stop_server(replica)
    return {"seconds": round(run["seconds"], 1), "hit_rates": hit_rates(deltas), "turns": turn_summary(run["records"])}


def memory_per_conversation(replicas: list[RunningServer], records: list[TurnRecord], kv_gib: float) -> dict:
    """What a warm conversation costs a replica, measured after a run: its session's host memory (token history,
    block list) and drafter state (/health over the sessions cached), and its KV: the pool's bytes per position
    (--kv-cache-memory over /health's kv_cache_positions) times the conversation's tokens (its last turn's prompt and
    answer, from the client's usage)."""
    healths = [httpx.get(r.base_url + "/health", timeout=10).json() for r in replicas]
    sessions = sum(h["num_sessions"] for h in healths)
    final = {}
    for r in records:
        if r.ttft_s is not None and r.turn >= final.get(r.tag, (0, 0))[0]:
            final[r.tag] = (r.turn, r.prompt_tokens + r.completion_tokens)
    tokens = statistics.mean(t for _, t in final.values())
    kv_per_token = kv_gib * 2**30 / healths[0]["kv_cache_positions"]
    kv_per_conversation = kv_per_token * tokens
    return {"sessions_cached": sessions,
            "session_host_bytes_per_conversation": round(sum(h["session_host_bytes"] for h in healths) / sessions),
            "drafter_state_bytes_per_conversation": round(sum(h["drafter_state_bytes"] for h in healths) / sessions),
            "tokens_per_conversation": round(tokens, 1), "kv_bytes_per_token": round(kv_per_token),
            "kv_bytes_per_conversation": round(kv_per_conversation),
            "conversations_warm_per_kv_gib": round(2**30 / kv_per_conversation, 1)}


def run_routed(router: RunningServer, metrics_url: str, replicas: list[RunningServer], conversations,
               max_tokens: int, during=None) -> tuple[dict, dict]:
    before = [replica_counts(r) for r in replicas if r.process.poll() is None]
    processed = router_processed(metrics_url)
    run = asyncio.run(replay_all(router.api_url, conversations, max_tokens, during))
    live = [r for r in replicas if r.process.poll() is None]
    deltas = [counts_between(b, replica_counts(r)) for b, r in zip(before, live)] if len(live) == len(before) else []
    after = router_processed(metrics_url)
    result = {"seconds": round(run["seconds"], 1), "hit_rates": hit_rates(deltas) if deltas else None,
              "turns": turn_summary(run["records"]),
              "replica_requests": {r.base_url: d["requests"] for r, d in zip(live, deltas)},
              "router_processed": {w: after.get(w, 0) - processed.get(w, 0) for w in after}}
    return result, run


def failover(router: RunningServer, replicas: list[RunningServer], victim: RunningServer, half: int):
    """DURING for the failover run: kill VICTIM once HALF conversations have their first answer, then time the
    router's verdict; the survivors' counts at the kill split the hit rate into before and after."""
    survivors = [r for r in replicas if r is not victim]

    async def during(start: float, progress: dict) -> dict:
        while progress.get(1, 0) < half:
            await asyncio.sleep(POLL_S)
        in_flight = httpx.get(victim.base_url + "/health", timeout=5).json()
        at_kill = [replica_counts(r) for r in survivors]
        killed = time.monotonic()
        kill_group(victim)
        unhealthy_after = await wait_for_worker(router.base_url, victim.base_url, False, killed)
        return {"killed_at_s": round(killed - start, 3), "router_unhealthy_after_s": unhealthy_after,
                "victim_running_at_kill": in_flight["num_running"], "victim_waiting_at_kill": in_flight["num_waiting"],
                "survivors_at_kill": at_kill}

    return during, survivors


def summarise_failover(run: dict, survivors: list[RunningServer]) -> dict:
    verdict = run["during"]
    killed_at = verdict["killed_at_s"]
    failures = [(t - killed_at, message) for r in run["records"] for t, message in r.errors]
    after = [counts_between(b, replica_counts(r)) for b, r in zip(verdict.pop("survivors_at_kill"), survivors)]
    retried = [r for r in run["records"] if r.errors]
    return {**verdict, "failed_attempts": len(failures),
            "later_turn_hits_by_window": hits_by_window(run["records"], killed_at),
            "failures_after_kill_s": sorted(round(t, 3) for t, _ in failures),
            "failure_kinds": sorted({message.split(":")[0] for _, message in failures}),
            "failed_turns_answered_on_retry": sum(r.ttft_s is not None for r in retried),
            "failed_turns_never_answered": sum(r.ttft_s is None for r in retried),
            "survivors_hit_rates_after_kill": hit_rates(after)}


def run_replicas(args, config, tokenizer, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    questions = load_questions("mt-redundant", args.data_dir)
    results = {"benchmark": "replicas", "command": "specserve " + shlex.join(sys.argv[1:]),
               "replicas": args.replicas, "conversations": args.conversations, "max_new_tokens": args.max_new_tokens,
               "router": {"binary": ROUTER_VERSION, "flags": list(ROUTER_FLAGS)}, "retries": RETRIES}
    routed_conversations = conversations_for(questions, args.conversations, "routed")
    results["single"] = run_single(args, routed_conversations, out_dir)
    threads = threads_per_replica(args)
    results["threads_per_replica"] = threads
    replicas = [start_replica(out_dir, free_port(), args, threads) for _ in range(args.replicas)]
    router, metrics_url = start_router(out_dir, replicas)
    try:
        results["routed"], run = run_routed(router, metrics_url, replicas, routed_conversations, args.max_new_tokens)
        results["memory"] = memory_per_conversation(replicas, run["records"], args.replica_kv_gib)
        victim = replicas[0]
        during, survivors = failover(router, replicas, victim, args.conversations // 2)
        failed, run = run_routed(router, metrics_url, replicas, conversations_for(questions, args.conversations,
                                                                                  "failover"),
                                 args.max_new_tokens, during)
        results["failover"] = {**failed, **summarise_failover(run, survivors)}
        restarted = time.monotonic()
        replicas[0] = start_replica(out_dir, int(victim.base_url.rsplit(":", 1)[1]), args, threads)
        back_after = asyncio.run(wait_for_worker(router.base_url, victim.base_url, True, restarted))
        back, _ = run_routed(router, metrics_url, replicas, conversations_for(questions, args.conversations, "back"),
                             args.max_new_tokens)
        results["back"] = {**back, "router_healthy_after_restart_s": back_after}
    finally:
        for server in [router, *replicas]:
            stop_server(server)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    return results


def add_replicas_flags(parser) -> None:
    parser.add_argument("--replicas", type=int, default=3, help="replicas behind the router")
    parser.add_argument("--conversations", type=int, default=48, help="concurrent three-turn conversations per run")
    parser.add_argument("--replica-kv-gib", type=float, default=0.5, help="each replica's --kv-cache-memory")
    parser.add_argument("--replica-threads", type=int, default=None,
                        help="each replica's --num-threads (default: this machine's cores shared out, at least 1)")


def markdown(results: dict) -> str:
    single, routed = results["single"], results["routed"]
    lines = [f"# {results['replicas']} replicas behind the Shepherd Model Gateway: sessions, latency, failover", "",
             f"Command: `{results['command']}`", "",
             f"{results['conversations']} concurrent conversations per run (MT-Redundant turns 1 and 2, then "
             f"\"{THIRD_TURN}\"), half naming a session (X-Session-ID), {results['max_new_tokens']} new tokens a "
             f"turn, greedy. Router: {results['router']['binary']} `{' '.join(results['router']['flags'])}`. One "
             f"replica runs with all of this machine's cores; each of the {results['replicas']} with "
             f"{results['threads_per_replica']} thread(s).", "",
             "| kind | hit rate, one replica | hit rate, router | turn 2 TTFT p50 one / router (s) | "
             "turn 3 TTFT p50 one / router (s) | failed attempts (router run) |", "|---|---|---|---|---|---|"]
    for kind in SESSION_KINDS:
        one, many = single["hit_rates"][kind], routed["hit_rates"][kind]
        t2, t3 = (f"{kind} turn {t}" for t in (2, 3))
        lines.append(f"| {kind} | {one['hit_rate']} ({one['hits']}/{one['hits'] + one['misses']}) | "
                     f"{many['hit_rate']} ({many['hits']}/{many['hits'] + many['misses']}) | "
                     f"{single['turns'][t2]['ttft_p50_s']} / {routed['turns'][t2]['ttft_p50_s']} | "
                     f"{single['turns'][t3]['ttft_p50_s']} / {routed['turns'][t3]['ttft_p50_s']} | "
                     f"{sum(routed['turns'][f'{kind} turn {t}']['failed_attempts'] for t in (1, 2, 3))} |")
    lines += ["", "Load per replica (requests it finished / the router's count): "
              + ", ".join(f"{url}: {n} / {routed['router_processed'].get(url, 0)}"
                          for url, n in routed["replica_requests"].items()),
              f"Run time: one replica {single['seconds']} s, router {routed['seconds']} s.", ""]
    fail = results["failover"]
    lines += ["## Failover", "",
              f"One replica SIGKILLed at {fail['killed_at_s']} s, with {fail['victim_running_at_kill']} requests "
              f"running and {fail['victim_waiting_at_kill']} waiting on it. The router marked it unhealthy "
              f"{fail['router_unhealthy_after_s']} s after the kill. {fail['failed_attempts']} attempts failed "
              f"({', '.join(fail['failure_kinds']) or 'none'}), at {fail['failures_after_kill_s']} s after the kill; "
              f"{fail['failed_turns_answered_on_retry']} of those turns were answered on a retry, "
              f"{fail['failed_turns_never_answered']} never.", "",
              "Later turns on the surviving replicas after the kill (their own counts): "
              + ", ".join(f"{k} {v['hit_rate']} ({v['hits']} hits, {v['misses']} misses)"
                          for k, v in fail["survivors_hit_rates_after_kill"].items()) + ".", "",
              "Hit rate of later turns as the client saw it (at least half the prompt cached), by when they started:",
              "", "| later turns started | turns | hit rate |", "|---|---|---|",
              *(f"| {w['window']} | {w['turns']} | {w['hit_rate']} |" for w in fail["later_turn_hits_by_window"]), ""]
    memory = results["memory"]
    lines += ["## What a warm conversation costs a replica", "",
              f"After the router run, {memory['sessions_cached']} sessions cached over the replicas: "
              f"{memory['session_host_bytes_per_conversation']} bytes of host memory each (token history, block "
              f"list and drafter state; the drafter state alone {memory['drafter_state_bytes_per_conversation']}), "
              f"and {memory['tokens_per_conversation']} tokens of KV at {memory['kv_bytes_per_token']} bytes a "
              f"token: {memory['kv_bytes_per_conversation']} bytes, so "
              f"{memory['conversations_warm_per_kv_gib']} such conversations stay warm per GiB of KV pool.", ""]
    back = results["back"]
    lines += ["## Back", "",
              f"The replica started again; the router sent it traffic {back['router_healthy_after_restart_s']} s "
              f"after the restart began. A further {results['conversations']} conversations: requests per replica "
              + ", ".join(f"{url}: {n}" for url, n in back["replica_requests"].items())
              + (f"; hit rates {json.dumps(back['hit_rates'])}" if back["hit_rates"] else "") + "."]
    return "\n".join(lines) + "\n"
