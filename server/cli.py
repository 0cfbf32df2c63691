"""`specserve serve`: flags in, one Config out, and the server run until stopped.

Every flag comes from a config field (server/flags.py); `engine_config` is what `calibrate` and `bench` build
their engines from too, with the drafter they choose."""
from __future__ import annotations

import argparse

from drafters.registry import DRAFTER_NAMES
from engine.config import EngineConfig
from engine.model.model_source import resolve_model_source
from engine.model.tokenizer import load_tokenizer
from server.app import build_app
from server.config import Config, ServerConfig
from server.drain import draining_server
from server.engine_client import EngineClient
from server.flags import add_config_flags, config_from_args
from server.metrics import ServerMetrics


def add_engine_flags(parser: argparse.ArgumentParser, with_drafter: bool = False) -> None:
    """The engine's flags; `--drafter` only where the command serves one drafter (bench and calibrate choose)."""
    add_config_flags(
        parser, EngineConfig, skip=() if with_drafter else ("drafter",), choices={"drafter": DRAFTER_NAMES}
    )


def engine_config(args: argparse.Namespace, drafter: str | None = None) -> EngineConfig:
    """The EngineConfig ARGS describe, drafting with DRAFTER (default: ARGS' own --drafter)."""
    return config_from_args(EngineConfig, args, **({"drafter": drafter} if drafter else {}))


def add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    add_engine_flags(serve, with_drafter=True)
    add_config_flags(serve, ServerConfig)
    serve.set_defaults(run=serve_until_stopped)


def serve_config(args: argparse.Namespace) -> Config:
    return Config(engine=engine_config(args), server=config_from_args(ServerConfig, args, api_key=args.api_key or None))


def serve_until_stopped(args: argparse.Namespace) -> None:
    """Serve until stopped; exit 1 when the engine cannot be kept running (server/supervision.py)."""
    config = serve_config(args)
    model_name = config.server.served_model_name or resolve_model_source(config.engine.model.model).name
    engine = EngineClient(config.engine, config.server, ServerMetrics(model_name))
    engine.spawn_first_engine()  # it loads its model while this process loads the tokenizer
    app = build_app(config, engine, load_tokenizer(config.engine.model))
    server = draining_server(app, app.state.serving, config.server.host, config.server.port)
    engine.on_give_up = lambda: setattr(server, "should_exit", True)
    server.run()
    if engine.gave_up:
        raise SystemExit(1)
