"""`specserve bench routing-sim`: the router as deployed, in front of many simulated replicas, for many conversations.

The real gateway (smg, the flags of bench/replicas.py) routes; the replicas are simulated in this process (aiohttp,
one port each): each answers /health, /v1/models and chat completions, after a service time that grows with the
requests it is running. A replica keeps the sessions of the conversations it served, least recently used first, up
to --warm-sessions (docs/deployment.md derives that figure from bench replicas' measured memory per conversation);
a later turn of a conversation is a hit where its replica holds it.

Conversations arrive as a Poisson process; each has 1 + Geometric(1 / (mean - 1)) turns (mean --mean-turns), with
an exponential think time between them; a share of them (--named-share) name their session (X-Session-ID and
session_id), the rest are placed by their text alone. Time runs faster than real time by --speedup (service, think
and arrival times divided by it): what matters to the router is the order and overlap of requests, which the
speedup keeps.
Halfway through, --replace of the replicas are replaced: they start failing health checks and requests (the router
drops them) and as many new ones join through the gateway's POST /workers. Reported per phase (before, after the
replacement) and per kind (named, unnamed): the hit rate of later turns, and the load imbalance (requests on the
busiest replica over the mean).
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import shlex
import statistics
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from bench.replicas import ROUTER_FLAGS, ROUTER_VERSION, router_command, wait_until_routed
from bench.server_process import free_port, start_process, stop_server

# words of a simulated question and answer: a typical chat turn's lengths, the answer several times the question, so
# a second turn's prompt is mostly new to the router
QUESTION_WORDS, ANSWER_WORDS = 60, 250
SERVICE_S = 0.5  # a replica's time to answer one request alone, in simulated seconds
SERVICE_PER_RUNNING_S = 0.05  # and what each request it runs besides adds
NAMED, UNNAMED = "named", "unnamed"


@dataclass
class Replica:
    url: str
    warm_sessions: int
    alive: bool = True
    running: int = 0
    served: int = 0
    sessions: OrderedDict = field(default_factory=OrderedDict)  # conversation -> None, least recently used first

    def serve_turn(self, conversation: str, kind: str, turn: int, counts: Counter, phase: str) -> None:
        if turn > 1:
            counts[(phase, kind, "hit" if conversation in self.sessions else "miss")] += 1
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
        self.counts: Counter = Counter()  # (phase, kind, hit / miss)
        self.calls: Counter = Counter()  # requests the replicas answered, by kind
        self.phase = "before"
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
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

    async def chat(self, request: web.Request) -> web.Response:
        replica = self.replica(request)
        self.calls["chat"] += 1
        if not replica.alive:
            return web.json_response({"error": {"message": "replica gone"}}, status=503)
        body = await request.json()
        conversation = body["messages"][0]["content"]
        kind = NAMED if body.get("session_id") else UNNAMED  # the gateway forwards the body, not X-Session-ID
        turn = sum(m["role"] == "user" for m in body["messages"])
        replica.running += 1
        try:
            await asyncio.sleep((SERVICE_S + SERVICE_PER_RUNNING_S * (replica.running - 1)) / self.speedup)
        finally:
            replica.running -= 1
        replica.serve_turn(conversation, kind, turn, self.counts, self.phase)
        answer = " ".join(f"w{random.randrange(5000)}" for _ in range(ANSWER_WORDS))
        return web.json_response({"object": "chat.completion", "model": "sim", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]})


async def converse(session: aiohttp.ClientSession, url: str, index: int, turns: int, think_s: float, named: bool,
                   errors: Counter) -> None:
    messages = [{"role": "system", "content": f"conversation {index}"}]
    # a named conversation sends its name twice, as specserve's clients behind the gateway do: X-Session-ID for the
    # gateway's placement (it reads headers) and session_id for the replica (the gateway forwards bodies, not headers)
    name = {"session_id": f"conversation-{index}"} if named else {}
    headers = {"X-Session-ID": name["session_id"]} if named else {}
    for _ in range(turns):
        question = " ".join(f"q{random.randrange(5000)}" for _ in range(QUESTION_WORDS))
        messages.append({"role": "user", "content": question})
        async with session.post(url + "/v1/chat/completions", json={"model": "sim", "messages": messages, **name},
                                headers=headers) as reply:
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
            await converse(session, router_url, index, turns_of(rng, args.mean_turns), args.think_s / speed,
                           rng.random() < args.named_share, errors)

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
        served = phases[name]["served"]
        report[name] = {**{kind: later_turns(replicas.counts, name, kind) for kind in (NAMED, UNNAMED)},
                        "load_imbalance_max_over_mean": imbalance(served),
                        "requests_per_replica_min_max": [min(served), max(served)]}
    return {"phases": report, "errors": dict(errors), "wall_seconds": round(seconds, 1),
            "chat_requests": replicas.calls["chat"],
            "arrivals_per_s_achieved": round(args.conversations / (seconds * speed), 2)}


def later_turns(counts: Counter, phase: str, kind: str) -> dict:
    hits, misses = counts[(phase, kind, "hit")], counts[(phase, kind, "miss")]
    return {"later_turns": hits + misses, "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None}


async def replace(session: aiohttp.ClientSession, router_url: str, replicas: SimulatedReplicas, count: int) -> None:
    """COUNT replicas start failing health checks and requests; as many new ones join through POST /workers."""
    for replica in list(r for r in replicas.by_port.values() if r.alive)[:count]:
        replica.alive = False
    for _ in range(count):
        replica = await replicas.add()
        async with session.post(router_url + "/workers", json={"url": replica.url}) as reply:
            if reply.status >= 300:
                raise RuntimeError(f"POST /workers answered {reply.status}: {await reply.text()}")


async def run(args, out_dir: Path) -> dict:
    replicas = SimulatedReplicas(args.warm_sessions, args.speedup)
    await replicas.start()
    initial = [await replicas.add() for _ in range(args.sim_replicas)]
    port = free_port()
    command = [*router_command(), "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--worker-urls", *[r.url for r in initial], *router_flags(args)]
    router = await asyncio.to_thread(start_process, command, port, out_dir)
    try:
        await asyncio.to_thread(wait_until_routed, router.base_url, [r.url for r in initial])
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
               "named_share": args.named_share, "router": ROUTER_VERSION,
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
    parser.add_argument("--speedup", type=float, default=10.0, help="simulated seconds per real second (this "
                        "machine's simulator kept up with 14 of 20 arrivals a second at 10, and 2.4 at 100)")
    parser.add_argument("--max-open", type=int, default=2000, help="conversations open at once, at most")
    parser.add_argument("--named-share", type=float, default=0.5, help="share of conversations that name their session "
                        "(X-Session-ID); the rest are placed by their text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-threshold", type=float, default=None,
                        help="the router's --cache-threshold instead of the deployed one (bench/replicas.py)")


def markdown(results: dict) -> str:
    lines = [f"# Routing simulation: {results['replicas']} replicas, {results['conversations']} conversations", "",
             f"Command: `{results['command']}`", "",
             f"The real router ({results['router']} `{' '.join(results['router_flags'])}`) in front of simulated "
             f"replicas (bench/routing_sim.py). Conversations arrive at {results['arrivals_per_s']}/s with a mean of "
             f"{results['mean_turns']} turns and {results['think_s']} s between turns, {results['named_share']} of "
             f"them naming their session, simulated {results['speedup']}x faster than real time "
             f"({results['wall_seconds']} s for {results['chat_requests']} chat requests; the simulator kept up with "
             f"{results['arrivals_per_s_achieved']} arrivals a simulated second); each replica keeps "
             f"{results['warm_sessions_per_replica']} sessions warm; {results['replaced']} replicas replaced halfway. "
             f"Errors: {results['errors'] or 'none'}.", "",
             "| phase | named: later turns | hit rate | unnamed: later turns | hit rate | load: busiest / mean | "
             "requests per replica (min, max) |", "|---|---|---|---|---|---|---|"]
    for name, phase in results["phases"].items():
        lines.append(f"| {name} | {phase[NAMED]['later_turns']} | {phase[NAMED]['hit_rate']} | "
                     f"{phase[UNNAMED]['later_turns']} | {phase[UNNAMED]['hit_rate']} | "
                     f"{phase['load_imbalance_max_over_mean']} | {phase['requests_per_replica_min_max']} |")
    return "\n".join(lines) + "\n"
