"""The FastAPI application: routes, error handlers, shared state and the engine's lifetime."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from server.config import Config
from server.engine_client import EngineClient
from server.errors import install_error_handlers
from server.openapi import document_request_bodies
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.responses_protocol import ResponsesRequest
from server.router import api_router, router, token_router
from server.serving import ServingContext

logger = logging.getLogger("specserve.server")


def build_app(config: Config, engine: EngineClient, tokenizer: Any) -> FastAPI:
    """The app; its lifespan starts the engine in the background and shuts it down.

    The server listens at once: /health (readiness) and every endpoint answer 503 until
    the engine's ready message arrives, and again while a dead engine is started again;
    /health/live stays 200 meanwhile (server/engine_client.py, server/supervision.py).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(start_engine(engine))
        try:
            yield
        finally:
            starting.cancel()
            await engine.shutdown()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.serving = ServingContext(config, engine, tokenizer)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(api_router)
    app.include_router(token_router)
    document_request_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                                  "/v1/responses": ResponsesRequest})
    return app


async def start_engine(engine: EngineClient) -> None:
    """Start the engine; on failure the client gives up (the server exits 1, see server/cli.py) and /health says why."""
    try:
        await engine.start()
        logger.info("engine ready: the server takes traffic")
    except Exception as exc:
        logger.error("the engine failed to start: %s", exc)
