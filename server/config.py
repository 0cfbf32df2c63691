"""The root configuration, built once from CLI flags and passed down by constructors."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None = the model's own name
    engine_start_timeout_s: float = 600.0  # seconds to wait for the engine's ready message
    engine_max_restarts: int = 5  # engine restarts allowed within engine_restart_window_s; one more death: exit 1
    engine_restart_window_s: float = 600.0
    engine_stall_timeout_s: float = 120.0  # an engine with work in flight that sends nothing this long is wedged
    drain_timeout_s: float = 30.0  # SIGTERM: seconds requests in flight get to finish before the server stops
    max_request_bytes: int = 4 * 1024 * 1024
    api_key: str | None = None  # None: no authentication
    max_choices: int = 16  # the largest `n` a request may ask for


    def __post_init__(self) -> None:
        if self.api_key == "":
            raise ValueError("an empty API key would accept anyone; leave it unset instead")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if self.engine_max_restarts < 0 or self.engine_restart_window_s <= 0:
            raise ValueError("engine restarts: the bound must not be negative and the window must be positive")
        if self.max_choices < 1:
            raise ValueError("--max-choices must be at least 1")
        if self.engine_stall_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("the stall bound must be positive and the drain timeout must not be negative")


@dataclass(frozen=True)
class Config:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
