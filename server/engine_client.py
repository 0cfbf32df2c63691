"""The server's handle on the engine process: starts and supervises it, and streams outputs per request."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import tempfile
import uuid
from typing import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.process import run_engine_process
from engine.wire import AbortRequest, EngineDead, EngineOutputs, EngineReady, EngineRequest, FromEngine, RequestOutput, StepStats
from server.metrics import ServerMetrics


class EngineDeadError(RuntimeError):
    pass


class QueueFullError(RuntimeError):
    pass


class EngineRequestError(ValueError):
    """The engine refused one request (the engine itself is fine)."""


class EngineClient:
    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0, metrics: ServerMetrics | None = None) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.metrics = metrics
        self.ready: EngineReady | None = None
        self.last_step_stats = StepStats()
        self.dead_reason: str | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._ready_or_dead = asyncio.Event()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._process: multiprocessing.Process | None = None
        self._reader: asyncio.Task | None = None

    @property
    def healthy(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    # --- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        input_address, output_address = _ipc_addresses()
        self._sync_context = zmq.Context()
        self._to_engine = self._sync_context.socket(zmq.PUSH)
        self._to_engine.bind(input_address)
        self._async_context = zmq.asyncio.Context()
        self._from_engine = self._async_context.socket(zmq.PULL)
        self._from_engine.bind(output_address)
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, args=(self.config, input_address, output_address), daemon=True, name="specserve-engine"
        )
        self._process.start()
        asyncio.get_running_loop().add_reader(self._process.sentinel, self._on_process_exit)
        self._reader = asyncio.create_task(self._read_outputs())
        try:
            await asyncio.wait_for(self._ready_or_dead.wait(), self.start_timeout_s)
        except asyncio.TimeoutError:
            self._mark_dead(f"no ready message within {self.start_timeout_s} s")
        if not self.healthy:
            raise EngineDeadError(f"the engine failed to start: {self.dead_reason}")

    async def shutdown(self) -> None:
        if self._process is None:
            return
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self._reader:
            self._reader.cancel()
        if self._process.is_alive():
            self._process.terminate()
            await asyncio.to_thread(self._process.join, 10)
        self._mark_dead("the engine was shut down")
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)

    def _on_process_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        self._mark_dead(f"the engine process exited with code {self._process.exitcode}")

    def _mark_dead(self, reason: str) -> None:
        if self.metrics:
            self.metrics.set_engine_healthy(False)
        if self.dead_reason is None:
            self.dead_reason = reason
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(self.dead_reason))
        self._ready_or_dead.set()

    # --- outputs --------------------------------------------------------------------------
    async def _read_outputs(self) -> None:
        while True:
            message = self._decoder.decode(await self._from_engine.recv())
            if isinstance(message, EngineOutputs):
                self._dispatch(message)
            elif isinstance(message, EngineReady):
                self.ready = message
                if self.metrics:
                    self.metrics.set_engine_healthy(True)
                self._ready_or_dead.set()
            elif isinstance(message, EngineDead):
                self._mark_dead(message.reason)

    def _dispatch(self, message: EngineOutputs) -> None:
        self.last_step_stats = message.stats
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
        self._queues[request.request_id] = queue
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
            if not finished:
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        if self.healthy:
            self._send(AbortRequest(request_id))

    def _send(self, message) -> None:
        self._to_engine.send(self._encoder.encode(message))


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
    base = os.path.join(tempfile.gettempdir(), f"specserve-{uuid.uuid4().hex[:12]}")
    return f"ipc://{base}-in", f"ipc://{base}-out"
