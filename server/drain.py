"""Graceful shutdown: on SIGTERM the server stops admitting, lets the requests in flight finish, then stops.

uvicorn stops at SIGTERM by closing its listening socket and cutting what is still
running after its grace period. Here the first SIGTERM starts a drain instead: the
server keeps listening, answers new API requests and the readiness probe with 503
and `Retry-After` (a load balancer that has not yet dropped this replica retries
elsewhere), waits until no request is in flight or `--drain-timeout` has passed, and
only then lets uvicorn stop (closing the engine in the app's lifespan). A second
SIGTERM, or SIGINT, stops at once as uvicorn does.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from server.serving import ServingContext

logger = logging.getLogger("specserve.server")

POLL_S = 0.1
CLOSE_GRACE_S = 5.0  # after the drain, seconds uvicorn gives connections to close


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, serving: ServingContext) -> None:
        super().__init__(config)
        self.serving = serving
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.serving.draining and not self.should_exit and self._loop is not None:
            self.serving.draining = True
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain(sig)))
            return
        super().handle_exit(sig, frame)

    async def _drain(self, sig: int) -> None:
        engine, timeout = self.serving.engine, self.serving.config.server.drain_timeout_s
        logger.info("SIGTERM: no new requests; %d in flight get up to %.0f s to finish", engine.num_in_flight, timeout)
        deadline = time.monotonic() + timeout
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if engine.num_in_flight:
            logger.warning("drain timeout: %d requests still in flight are cut", engine.num_in_flight)
        super().handle_exit(sig, None)


def draining_server(app, serving: ServingContext, host: str, port: int) -> DrainingServer:
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=CLOSE_GRACE_S)
    return DrainingServer(config, serving)
