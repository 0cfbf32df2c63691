"""The engine process: receives requests over ZeroMQ, steps the engine, sends one outputs message per step."""
from __future__ import annotations

import logging
import os
import signal
import traceback

import msgspec
import zmq

from engine.config import EngineConfig
from engine.wire import AbortRequest, EngineDead, EngineError, EngineOutputs, RequestOutput, StepStats, ToEngine
from scheduler.admission import QueueFullError

logger = logging.getLogger("specserve.engine")

IDLE_POLL_MS = 1000  # while idle, how often the engine checks that its server still exists
SEND_TIMEOUT_MS = 1000  # while a send waits for the server, how often the engine checks that it still exists


class EngineLoop:
    def __init__(self, config: EngineConfig, input_address: str, output_address: str) -> None:
        self.config = config
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.connect(input_address)
        self.outbox = self.context.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self.outbox.connect(output_address)
        self.decoder = msgspec.msgpack.Decoder(ToEngine)
        self.encoder = msgspec.msgpack.Encoder()
        self.engine = None
        self.parent_pid = os.getppid()

    def send(self, message) -> None:
        """Waits for the server as long as it exists: a PUSH to a server that is gone would wait for ever, leaving an
        orphaned engine holding its memory."""
        raw = self.encoder.encode(message)
        while True:
            try:
                return self.outbox.send(raw)
            except zmq.Again:
                self._exit_if_orphaned()

    def run(self) -> None:
        from engine.engine import Engine, freeze_start_up_objects  # local: torch, the model load in the child only

        self.engine = Engine(self.config)
        freeze_start_up_objects()
        ready = self.engine.ready_message()
        logger.info("%s weights; forward latency profile (ms by tokens): %s", ready.weights,
                    {n: round(ms, 1) for n, ms in ready.latency_ms_by_num_tokens.items()})
        self.send(ready)
        while True:
            self._exit_if_orphaned()
            if not self.engine.has_work and not self.inbox.poll(IDLE_POLL_MS):
                self._expire_idle_sessions()
                continue
            replies = self._drain_inbox()
            if self.engine.has_work:
                step_outputs = self.engine.step()
                step_outputs.outputs[:0] = replies
                self.send(step_outputs)
            elif replies:
                self.send(EngineOutputs(outputs=replies, stats=StepStats()))

    def _expire_idle_sessions(self) -> None:
        """Sessions past their TTL go while no request runs too; the server learns of it like after a step."""
        stats = self.engine.expire_idle_sessions()
        if stats is not None:
            self.send(EngineOutputs(outputs=[], stats=stats))

    def _drain_inbox(self) -> list[RequestOutput]:
        replies = []
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return replies
            reply = self._handle(self.decoder.decode(raw))
            if reply is not None:
                replies.append(reply)

    def _exit_if_orphaned(self) -> None:
        """A server killed outright cannot stop its engine: the engine notices and leaves."""
        if os.getppid() != self.parent_pid:
            logger.info("the server process is gone; the engine exits")
            raise SystemExit(0)

    def _handle(self, message) -> RequestOutput | None:
        if isinstance(message, AbortRequest):
            return self.engine.abort(message.request_id)
        try:
            return self.engine.add_request(message)
        except QueueFullError as exc:
            return RequestOutput(
                message.request_id, [], finish_reason="error", error=EngineError("queue_full", str(exc))
            )


def run_engine_process(config: EngineConfig, input_address: str, output_address: str) -> None:
    """Entry point of the child process; reports a fatal error before exiting.

    SIGINT and SIGTERM are the server's to act on (Ctrl-C and `kill -- -PGID` reach the whole process group): the
    server drains and then stops the engine; a server that vanishes is noticed by the engine itself.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO)
    loop = EngineLoop(config, input_address, output_address)
    try:
        loop.run()
    except Exception as exc:  # the server must learn why the engine died
        logger.error("engine died: %s", traceback.format_exc())
        loop.send(EngineDead(reason=f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1)
