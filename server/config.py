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
    max_request_bytes: int = 4 * 1024 * 1024
    api_key: str | None = None  # None: no authentication

    def __post_init__(self) -> None:
        if self.api_key == "":
            raise ValueError("an empty API key would accept anyone; leave it unset instead")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")


@dataclass(frozen=True)
class Config:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
