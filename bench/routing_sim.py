"""`specserve bench routing-sim`: the router as deployed, in front of many simulated replicas, for many conversations.

The real vllm-router (the flags of bench/replicas.py) routes; the replicas are simulated in this process (aiohttp,
one port each): each answers /health, /v1/models, /tokenize (a word's token id is a hash of it, so a later turn's
tokens start with the earlier turns', as real ones do) and chat completions, after a service time that grows with
the requests it is running. A replica keeps the sessions of the conversations it served, least recently used first,
up to --warm-sessions (docs/deployment.md derives that figure from bench replicas' measured memory per
conversation); a later turn of a conversation is a hit where its replica holds it.

Conversations arrive as a Poisson process; each has 1 + Geometric(1 / (mean - 1)) turns (mean --mean-turns), with
an exponential think time between them. Time runs faster than real time by --speedup (service, think and arrival
times divided by it): what matters to the router is the order and overlap of requests, which the speedup keeps.
Halfway through, --replace of the replicas are replaced: they start failing health checks (the router drops them)
and as many new ones are added through the router's /add_worker. Reported per phase (before, during the
replacement's aftermath, after): hit rate of later turns, the load imbalance (requests on the busiest replica over
the mean), and how many conversations moved.
"""
from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import shlex
import statistics
import sys
import time
import zlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from bench.replicas import ROUTER_FLAGS, router_binary
from bench.server_process import free_port, start_process, stop_server

# words (one stand-in token each) of a simulated question and answer: a typical chat turn's lengths, the answer
# several times the question, so a second turn's prompt is mostly new to the router
QUESTION_WORDS, ANSWER_WORDS = 60, 250
SERVICE_S = 0.5  # a replica's time to answer one request alone, in simulated seconds
SERVICE_PER_RUNNING_S = 0.05  # and what each request it runs besides adds


def token_ids(messages: list[dict]) -> list[int]:
    """Stand-in tokens: one per word, a hash of the word; so a conversation's later turn starts with its earlier
    turns' tokens and different conversations share only their common words' positions."""
    return [token for m in messages for token in message_tokens(m["role"], m["content"])]


@functools.lru_cache(maxsize=1 << 16)
def message_tokens(role: str, content: str) -> tuple[int, ...]:
    """The router asks every replica for every request's tokens (one /tokenize per replica per request): the same
    messages come back many times."""
    return tuple(zlib.crc32(word.encode()) % 50_000 for word in f"{role}: {content}".split())


@dataclass
class Replica:
    url: str
    warm_sessions: int
    alive: bool = True
    running: int = 0
    served: int = 0
    sessions: OrderedDict = field(default_factory=OrderedDict)  # conversation -> None, least recently used first

    def serve_turn(self, conversation: str, turn: int, counts: Counter, phase: str) -> None:
        if turn > 1:
            counts[(phase, "hit" if conversation in self.sessions else "miss")] += 1
        self.sessions[conversation] = None
        self.sessions.move_to_end(conversation)
        while len(self.sessions) > self.warm_sessions:
            self.sessions.popitem(last=False)
        self.served += 1


class SimulatedReplicas:
    """Every simulated replica in one aiohttp application, told apart by the port a request came in on."""

    def __init__(self, warm_sessions: int, speedup: float) -> None:
        self.by_port: dict[int, Replica] = {}
        self.warm_sessions, self.speedup = warm_sessions, speedup
        self.counts: Counter = Counter()  # (phase, hit / miss)
        self.calls: Counter = Counter()  # requests the replicas answered, by kind
        self.phase = "before"
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(self.app, access_log=None)

    async def start(self) -> None:
        await self.runner.setup()

    async def add(self) -> Replica:
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        replica = self.by_port[port] = Replica(f"http://127.0.0.1:{port}", self.warm_sessions)
        return replica

    def replica(self, request: web.Request) -> Replica:
        return self.by_port[request.transport.get_extra_info("sockname")[1]]

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"}, status=200 if self.replica(request).alive else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "sim", "object": "model"}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        self.calls["tokenize"] += 1
        tokens = token_ids((await request.json())["messages"])
        return web.json_response({"count": len(tokens), "max_model_len": 1 << 20, "tokens": tokens})

    async def chat(self, request: web.Request) -> web.Response:
        replica = self.replica(request)
        self.calls["chat"] += 1
        if not replica.alive:
            return web.json_response({"error": {"message": "replica gone"}}, status=503)
        body = await request.json()
        conversation = body["messages"][0]["content"]
        turn = sum(m["role"] == "user" for m in body["messages"])
        replica.running += 1
        try:
            await asyncio.sleep((SERVICE_S + SERVICE_PER_RUNNING_S * (replica.running - 1)) / self.speedup)
        finally:
            replica.running -= 1
        replica.serve_turn(conversation, turn, self.counts, self.phase)
        answer = " ".join(f"w{random.randrange(5000)}" for _ in range(ANSWER_WORDS))
        return web.json_response({"object": "chat.completion", "model": "sim", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]})


async def converse(session: aiohttp.ClientSession, url: str, index: int, turns: int, think_s: float,
                   errors: Counter) -> None:
    messages = [{"role": "system", "content": f"conversation {index}"}]
    for _ in range(turns):
        question = " ".join(f"q{random.randrange(5000)}" for _ in range(QUESTION_WORDS))
        messages.append({"role": "user", "content": question})
        async with session.post(url + "/v1/chat/completions", json={"model": "sim", "messages": messages}) as reply:
            if reply.status != 200:
                errors[reply.status] += 1
                return
            answer = (await reply.json())["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(random.expovariate(1 / think_s))


def turns_of(rng: random.Random, mean: float) -> int:
    """1 + a geometric count on 0, 1, 2, .. with mean MEAN - 1: P(k) = (1 - p)^k p, p = 1 / MEAN."""
    if mean <= 1:
        return 1
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / mean))


def imbalance(served: list[int]) -> float:
    return round(max(served) / statistics.mean(served), 3) if served and statistics.mean(served) else 0.0


async def simulate(args, router_url: str, replicas: SimulatedReplicas) -> dict:
    rng = random.Random(args.seed)
    random.seed(args.seed)
    errors: Counter = Counter()
    phases: dict[str, dict] = {}
    speed = args.speedup
    replaced_at = args.conversations // 2
    open_conversations = asyncio.Semaphore(args.max_open)

    async def one(session, index):
        async with open_conversations:
            await converse(session, router_url, index, turns_of(rng, args.mean_turns), args.think_s / speed, errors)

    def snapshot(name: str) -> None:
        live = [r for r in replicas.by_port.values() if r.alive]
        phases[name] = {"served": [r.served for r in live]}

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = []
        start = time.monotonic()
        for index in range(args.conversations):
            if index == replaced_at:
                snapshot("before")
                replicas.phase = "after the replacement"
                await replace(session, router_url, replicas, args.replace)
                for replica in replicas.by_port.values():
                    replica.served = 0
            tasks.append(asyncio.create_task(one(session, index)))
            await asyncio.sleep(rng.expovariate(args.arrivals_per_s * speed))
        await asyncio.gather(*tasks)
        snapshot("after the replacement")
    seconds = time.monotonic() - start
    report = {}
    for name in ("before", "after the replacement"):
        hits, misses = replicas.counts[(name, "hit")], replicas.counts[(name, "miss")]
        report[name] = {"later_turns": hits + misses, "hit_rate": round(hits / (hits + misses), 4) if hits + misses
                        else None, "load_imbalance_max_over_mean": imbalance(phases[name]["served"]),
                        "requests_per_replica_min_max": [min(phases[name]["served"]), max(phases[name]["served"])]}
    return {"phases": report, "errors": dict(errors), "wall_seconds": round(seconds, 1),
            "tokenize_calls_per_chat_request": round(replicas.calls["tokenize"] / max(replicas.calls["chat"], 1), 2)}


async def replace(session: aiohttp.ClientSession, router_url: str, replicas: SimulatedReplicas, count: int) -> None:
    """COUNT replicas start failing health checks and requests; as many new ones join through /add_worker."""
    for replica in list(r for r in replicas.by_port.values() if r.alive)[:count]:
        replica.alive = False
    for _ in range(count):
        replica = await replicas.add()
        async with session.post(router_url + "/add_worker", params={"url": replica.url}) as reply:
            if reply.status >= 300:
                raise RuntimeError(f"/add_worker answered {reply.status}: {await reply.text()}")


async def run(args, out_dir: Path) -> dict:
    replicas = SimulatedReplicas(args.warm_sessions, args.speedup)
    await replicas.start()
    initial = [await replicas.add() for _ in range(args.sim_replicas)]
    port = free_port()
    command = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--worker-urls", *[r.url for r in initial], *router_flags(args)]
    router = await asyncio.to_thread(start_process, command, port, out_dir)
    try:
        return await simulate(args, router.base_url, replicas)
    finally:
        await asyncio.to_thread(stop_server, router)
        await replicas.runner.cleanup()


def router_flags(args) -> list[str]:
    """The deployed flags (bench/replicas.py), with --cache-threshold replaced where the run names one."""
    flags = list(ROUTER_FLAGS)
    if args.cache_threshold is not None:
        flags[flags.index("--cache-threshold") + 1] = str(args.cache_threshold)
    return flags


def run_routing_sim(args, config, tokenizer, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"benchmark": "routing-sim", "command": "specserve " + shlex.join(sys.argv[1:]),
               "replicas": args.sim_replicas, "conversations": args.conversations, "mean_turns": args.mean_turns,
               "warm_sessions_per_replica": args.warm_sessions, "replaced": args.replace,
               "arrivals_per_s": args.arrivals_per_s, "think_s": args.think_s, "speedup": args.speedup,
               "max_open": args.max_open, "router_flags": router_flags(args),
               **asyncio.run(run(args, out_dir))}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    return results


def add_routing_sim_flags(parser) -> None:
    parser.add_argument("--sim-replicas", type=int, default=100, help="simulated replicas behind the router")
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--mean-turns", type=float, default=3.0, help="mean turns per conversation (at least 1)")
    parser.add_argument("--warm-sessions", type=int, default=80, help="sessions a replica keeps, LRU (bench "
                        "replicas measured 81 of SmolLM2's per GiB of KV pool)")
    parser.add_argument("--replace", type=int, default=10, help="replicas replaced halfway through")
    parser.add_argument("--arrivals-per-s", type=float, default=20.0, help="new conversations per simulated second")
    parser.add_argument("--think-s", type=float, default=30.0, help="mean simulated seconds between a reply and the "
                        "next turn")
    parser.add_argument("--speedup", type=float, default=100.0, help="simulated seconds per real second")
    parser.add_argument("--max-open", type=int, default=2000, help="conversations open at once, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-threshold", type=float, default=None,
                        help="the router's --cache-threshold instead of the deployed one (bench/replicas.py)")


def markdown(results: dict) -> str:
    lines = [f"# Routing simulation: {results['replicas']} replicas, {results['conversations']} conversations", "",
             f"Command: `{results['command']}`", "",
             f"The real router (`{' '.join(results['router_flags'])}`) in front of simulated replicas "
             f"(bench/routing_sim.py). Conversations arrive at {results['arrivals_per_s']}/s with a mean of "
             f"{results['mean_turns']} turns and {results['think_s']} s between turns, simulated {results['speedup']}x "
             f"faster than real time ({results['wall_seconds']} s); each replica keeps "
             f"{results['warm_sessions_per_replica']} sessions warm; {results['replaced']} replicas replaced halfway. "
             f"Errors: {results['errors'] or 'none'}. The router asked the replicas for "
             f"{results['tokenize_calls_per_chat_request']} tokenizations per chat request.", "",
             "| phase | later turns | hit rate | load: busiest / mean | requests per replica (min, max) |",
             "|---|---|---|---|---|"]
    for name, phase in results["phases"].items():
        lines.append(f"| {name} | {phase['later_turns']} | {phase['hit_rate']} | "
                     f"{phase['load_imbalance_max_over_mean']} | {phase['requests_per_replica_min_max']} |")
    return "\n".join(lines) + "\n"
