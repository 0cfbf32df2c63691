"""The FastAPI application: routes, error handlers, shared state and the engine's lifetime."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from server.config import Config
from server.engine_client import EngineClient
from server.errors import install_error_handlers
from server.router import router
from server.serving import ServingContext


def build_app(config: Config, engine: EngineClient, tokenizer: Any) -> FastAPI:
    """The app; its lifespan starts the engine (awaiting its ready message) and shuts it down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.state.serving = ServingContext(config, engine, tokenizer)
    install_error_handlers(app)
    app.include_router(router)
    return app
