"""The server's handle on the engine process: starts it, starts it again when it dies, streams outputs per request."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import re
import tempfile
import time
import uuid
from collections import Counter
from typing import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.process import run_engine_process
from engine.wire import (
    AbortRequest,
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    FromEngine,
    RequestOutput,
    StepStats,
)
from scheduler.admission import QueueFullError
from server.config import ServerConfig
from server.metrics import ServerMetrics
from server.supervision import RestartBudget, death_cause, exit_reason

logger = logging.getLogger("specserve.server")
SOCKET_FILE = re.compile(r"specserve-(\d+)-[0-9a-f]{12}-(?:in|out)")  # a server's pid, then the engine's id


class EngineDeadError(RuntimeError):
    pass


class EngineRequestError(ValueError):
    """The engine refused one request (the engine itself is fine)."""


class EngineProcess:
    """One engine process and the two sockets the server talks to it through."""

    def __init__(self, config: EngineConfig) -> None:
        input_address, output_address = _ipc_addresses()
        self.socket_files = [address.removeprefix("ipc://") for address in (input_address, output_address)]
        self._sync_context = zmq.Context()
        self._to_engine = self._sync_context.socket(zmq.PUSH)
        self._to_engine.bind(input_address)
        self._async_context = zmq.asyncio.Context()
        self._from_engine = self._async_context.socket(zmq.PULL)
        self._from_engine.bind(output_address)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, args=(config, input_address, output_address), daemon=True,
            name="specserve-engine",
        )
        self.dead = False  # the client has seen it die (or stopped it)
        self.reader: asyncio.Task | None = None  # the client's task reading its outputs

    def send(self, data: bytes) -> None:
        self._to_engine.send(data)

    async def recv(self) -> bytes:
        return await self._from_engine.recv()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()

    async def reap(self, grace_s: float) -> None:
        """Wait for the process to end (killing it after GRACE_S), then close the sockets."""
        await asyncio.to_thread(self.process.join, grace_s)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        if self.reader is not None and self.reader is not asyncio.current_task():
            self.reader.cancel()
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._sync_context.term()
        self._async_context.term()
        for path in self.socket_files:  # ZeroMQ leaves the files of bound ipc sockets behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class EngineClient:
    """The server's handle on its engine: starts the engine process, starts it again when it dies or wedges
    (server/supervision.py), and streams each request's outputs."""

    def __init__(
        self,
        config: EngineConfig,
        server: ServerConfig = ServerConfig(),
        metrics: ServerMetrics | None = None,
        on_give_up: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.server = server
        self.metrics = metrics
        self.on_give_up = on_give_up  # called once the restart budget is spent (the server then exits non-zero)
        self.ready: EngineReady | None = None
        self.last_step_stats = StepStats()
        # later turns of conversations since the server started, by kind: continued from a cached session, or not
        self.session_hits: Counter[str] = Counter()
        self.session_misses: Counter[str] = Counter()
        self.dead_reason: str | None = None  # why the current engine is not serving
        self.gave_up: str | None = None  # why the server stopped restarting engines
        self.num_restarts = 0
        self.last_exit_reason: str | None = None
        self._budget = RestartBudget(server.engine_max_restarts, server.engine_restart_window_s)
        self._queues: dict[str, asyncio.Queue] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._engine: EngineProcess | None = None
        self._ready_or_dead = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._last_progress = time.monotonic()  # last output from the engine, or first submission after a quiet spell
        self._stopping = False
        self._served = False  # an engine has been ready once: from then on a dead one is started again

    @property
    def healthy(self) -> bool:
        """Ready: an engine is up and serving."""
        return self.ready is not None and self.dead_reason is None

    @property
    def live(self) -> bool:
        """The server and its engine supervision work (also while an engine loads or restarts)."""
        return self.gave_up is None

    @property
    def pid(self) -> int | None:
        return self._engine.process.pid if self._engine else None

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # --- life cycle -----------------------------------------------------------------------
    def spawn_first_engine(self) -> None:
        """Start the first engine's process now, before the server's own start-up (its tokenizer, its app), so that
        the two load side by side; `start` then waits for it."""
        self._engine = EngineProcess(self.config)
        self._engine.process.start()

    async def start(self) -> None:
        """Start the first engine (or wait for the one spawn_first_engine started). One that never becomes ready is
        not started again (see supervision.py)."""
        await self._launch()
        if not self.healthy:
            self._give_up(f"the engine failed to start: {self.dead_reason}")
            raise EngineDeadError(self.gave_up)
        self._served = True
        self._spawn(self._watch_for_stalls())

    async def shutdown(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        engine = self._engine
        if engine is None or engine.dead:
            return
        self._on_death(engine, "the engine was shut down")
        engine.kill()  # it ignores SIGTERM (engine/process.py) and has nothing to flush
        await engine.reap(grace_s=10)

    async def _launch(self) -> None:
        if self._engine is None or self._engine.dead:
            self._engine = EngineProcess(self.config)
        engine = self._engine
        self.ready, self.dead_reason = None, None
        self._ready_or_dead = asyncio.Event()
        if engine.process.pid is None:
            engine.process.start()
        asyncio.get_running_loop().add_reader(engine.process.sentinel, self._on_process_exit, engine)
        engine.reader = self._spawn(self._read_outputs(engine))
        try:
            await asyncio.wait_for(self._ready_or_dead.wait(), self.server.engine_start_timeout_s)
        except asyncio.TimeoutError:
            self._on_death(engine, f"start_timeout: no ready message within {self.server.engine_start_timeout_s} s")
            engine.kill()

    def _on_process_exit(self, engine: EngineProcess) -> None:
        # Reap it, so that its exit code is known: its sentinel may close a moment before the kernel lets it be
        # reaped, and a non-blocking poll would then find no exit code.
        engine.process.join(timeout=1)
        self._on_death(engine, exit_reason(engine.process.exitcode))

    def _on_death(self, engine: EngineProcess, reason: str) -> None:
        """ENGINE is gone (or must go): fail what it was doing, and start another unless the server is stopping."""
        if engine.dead:
            return
        engine.dead = True
        asyncio.get_running_loop().remove_reader(engine.process.sentinel)
        self.dead_reason = self.dead_reason or reason
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(self.dead_reason))
        self._ready_or_dead.set()
        if self._stopping:
            return
        self.last_exit_reason = reason
        logger.error("engine died: %s", reason)
        if self.metrics:
            self.metrics.engine_died(death_cause(reason))
        if self._served and self.gave_up is None:
            self._spawn(self._restart(engine))

    async def _restart(self, dead: EngineProcess) -> None:
        await dead.reap(grace_s=5)
        delay = self._budget.next_delay()
        if delay is None:
            self._give_up(f"the engine died too often ({self._budget.max_restarts} restarts within "
                          f"{self._budget.window_s:g} s); last: {self.last_exit_reason}")
            return
        logger.warning("starting the engine again in %.0f s", delay)
        await asyncio.sleep(delay)
        self.num_restarts += 1
        if self.metrics:
            self.metrics.engine_restarted()
        await self._launch()
        if self.healthy:
            logger.info("engine restarted (%d so far): the server takes traffic again", self.num_restarts)

    def _give_up(self, reason: str) -> None:
        if self.gave_up is not None:
            return
        self.gave_up = reason
        logger.critical("%s: the server stops", reason)
        if self.on_give_up:
            self.on_give_up()

    async def _watch_for_stalls(self) -> None:
        """An engine that has work in flight but sends nothing for longer than the stall bound is treated as dead."""
        bound = self.server.engine_stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, bound / 4))
            quiet = time.monotonic() - self._last_progress
            if self.healthy and self._queues and quiet > bound:
                self._on_death(
                    self._engine, f"wedged: no output for {quiet:.0f} s with {len(self._queues)} requests in flight"
                )
                self._engine.kill()

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- outputs --------------------------------------------------------------------------
    async def _read_outputs(self, engine: EngineProcess) -> None:
        while not engine.dead:
            message = self._decoder.decode(await engine.recv())
            self._last_progress = time.monotonic()
            if isinstance(message, EngineOutputs):
                self._dispatch(message)
            elif isinstance(message, EngineReady):
                self.ready = message
                if self.metrics:
                    self.metrics.set_engine_healthy(True)
                self._ready_or_dead.set()
            elif isinstance(message, EngineDead):
                self._on_death(engine, f"error: {message.reason}")

    def _dispatch(self, message: EngineOutputs) -> None:
        self.last_step_stats = message.stats
        self.session_hits.update(message.stats.conversation_hits)
        self.session_misses.update(message.stats.conversation_misses)
        if self.metrics:
            self.metrics.observe_step(message.stats)
        for output in message.outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    # --- requests -------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until the finishing one; closing early aborts it in the engine."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not ready")
        queue: asyncio.Queue = asyncio.Queue()
        if not self._queues:
            self._last_progress = time.monotonic()  # the stall clock starts when work does
        self._queues[request.request_id] = queue
        engine = self._engine
        timer = self.metrics.request_timer() if self.metrics else None
        finished = False
        try:
            self._send(request)
            while not finished:
                output = _raise_if_failed(await queue.get())
                finished = output.finish_reason is not None
                if timer:
                    timer.on_output(output)
                yield output
        finally:
            del self._queues[request.request_id]
            if not finished and engine is self._engine:
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        if self.healthy:
            self._send(AbortRequest(request_id))

    def _send(self, message) -> None:
        self._engine.send(self._encoder.encode(message))


def _raise_if_failed(item: RequestOutput | Exception) -> RequestOutput:
    if isinstance(item, Exception):
        raise item
    if item.finish_reason == "error":
        if item.error is None:
            raise EngineRequestError("the engine refused the request")
        if item.error.kind == "queue_full":
            raise QueueFullError(item.error.message)
        raise EngineRequestError(item.error.message)
    return item


def _ipc_addresses() -> tuple[str, str]:
    """A new engine's socket addresses, named after this server's pid, after sweeping up those of dead servers."""
    directory = tempfile.gettempdir()
    remove_stale_socket_files(directory)
    base = os.path.join(directory, f"specserve-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    return f"ipc://{base}-in", f"ipc://{base}-out"


def remove_stale_socket_files(directory: str) -> list[str]:
    """Remove from DIRECTORY the ipc socket files of servers no longer running (a server closes its own; one killed
    outright leaves them behind), known by the pid in their names; the paths removed."""
    removed = []
    for name in os.listdir(directory):
        match = SOCKET_FILE.fullmatch(name)
        if match is None or _is_running(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
    return removed


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):  # no such process, or a number no pid can be
        return False
    except PermissionError:  # another user's process
        return True
    return True
