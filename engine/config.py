"""Engine configuration: the model, its device and dtype, and the sub-configs the engine composes."""
from __future__ import annotations

from dataclasses import dataclass, field

from drafters.config import SpecConfig
from scheduler.config import SESSION_MODES, SchedulerConfig, SessionConfig

DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "sdpa", "flash")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_MODES = ("auto", "float32", "bfloat16", "int8", "int4", "w4a8")  # engine/weights.py; kept here so config imports no torch


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # HF id, local directory or .gguf file; None = embedded default
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None  # None = the model's own limit, capped at 8192
    trust_remote_code: bool = False
    num_threads: int | None = None  # CPU threads for torch; None = torch's default
    seed: int = 0  # torch's global seed, for requests sampled without a seed of their own
    cache_dir: str | None = None  # tables derived from the model (drafters); None = $XDG_CACHE_HOME/specserve
    weights: str = "auto"  # how Linear layers keep their weights: auto | float32 | bfloat16 | int8 | int4 | w4a8 (engine/weights.py)
    draft_model: str | None = None  # early-exit:N, or what `model` takes; None = no draft model (engine/draft_model.py)
    companion_model: str | None = None  # SV's companion: the same forms (engine/companion.py); None = statistics only

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError("max_model_len must be at least 16")


@dataclass(frozen=True)
class CacheConfig:
    kv_cache_memory_gib: float = 2.0  # memory of the paged KV pool, allocated at start-up
    block_size: int | None = None  # positions per KV block; None = 16, or 256 for flash-attn
    attention_backend: str = "auto"  # auto | sdpa | flash (flash-attn on CUDA, when installed)

    def __post_init__(self) -> None:
        if self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib must be positive")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
