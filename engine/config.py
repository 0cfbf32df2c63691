"""Engine configuration: the model, its device and dtype, and the sub-configs the engine composes."""
from __future__ import annotations

from dataclasses import dataclass, field

from drafters.config import SpecConfig
from scheduler.config import SchedulerConfig

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # HF id, local directory or .gguf file; None = embedded default
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None  # None = the model's own limit, capped at 8192
    trust_remote_code: bool = False
    num_threads: int | None = None  # CPU threads for torch; None = torch's default
    seed: int = 0  # torch's global seed, for requests sampled without a seed of their own

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError("max_model_len must be at least 16")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
