"""The root configuration, built once from CLI flags and passed down by constructors.

A field with a "help" in its metadata is also a command-line flag (server/flags.py makes them)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig

API_KEY_ENV = "SPECSERVE_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the model name /v1/models shows and requests use (default: the model's own)"})
    engine_start_timeout_s: float = field(default=600.0, metadata={"flag": "--engine-start-timeout", "help": (
        "seconds an engine may take to load before it counts as failed (raise it for large models)")})
    engine_max_restarts: int = field(default=5, metadata={
        "help": "engine restarts allowed within --engine-restart-window; one more death and the server exits 1"})
    engine_restart_window_s: float = field(
        default=600.0, metadata={"flag": "--engine-restart-window", "help": "seconds"})
    engine_stall_timeout_s: float = field(default=120.0, metadata={"flag": "--engine-stall-timeout", "help": (
        "seconds an engine with requests in flight may send nothing before it is treated as dead")})
    drain_timeout_s: float = field(default=30.0, metadata={"flag": "--drain-timeout", "help": (
        "SIGTERM: seconds requests in flight get to finish while new ones get 503")})
    max_request_bytes: int = 4 * 1024 * 1024
    api_key: str | None = field(default=None, metadata={  # None: no authentication
        "env": API_KEY_ENV, "help": f"require this bearer key on /v1 (default: ${API_KEY_ENV})"})
    max_choices: int = field(default=16, metadata={"help": "the largest n a request may ask for"})
    responses_store_mib: float = field(default=64.0, metadata={"help": (
        "memory for stored Responses API responses (what previous_response_id continues); the oldest go first")})

    def __post_init__(self) -> None:
        if self.api_key == "":
            raise ValueError("an empty API key would accept anyone; leave it unset instead")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if self.engine_max_restarts < 0 or self.engine_restart_window_s <= 0:
            raise ValueError("engine restarts: the bound must not be negative and the window must be positive")
        if self.max_choices < 1:
            raise ValueError("--max-choices must be at least 1")
        if self.responses_store_mib < 0:
            raise ValueError("--responses-store-mib must not be negative")
        if self.engine_stall_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("the stall bound must be positive and the drain timeout must not be negative")


@dataclass(frozen=True)
class Config:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
