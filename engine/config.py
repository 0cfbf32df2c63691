"""Engine configuration: the model, its device and dtype, and the sub-configs the engine composes.

A field with a "help" in its metadata is also a command-line flag (server/flags.py makes them)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from drafters.config import SpecConfig
from scheduler.config import SchedulerConfig, SessionConfig

DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "sdpa", "triton", "flash")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# engine/model/weights.py's modes, kept here so that the config imports no torch
WEIGHT_MODES = ("auto", "float32", "bfloat16", "int8", "int4", "gguf")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(default=None, metadata={
        "help": "HF model id, local directory or .gguf file (default: embedded SmolLM2-135M-Instruct)"})
    device: str = field(default="auto", metadata={"help": "where the models run", "choices": DEVICES})
    dtype: str = field(default="auto", metadata={
        "help": "the model's dtype (auto: float32 on CPU, bfloat16 on CUDA)", "choices": DTYPES})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length in tokens (default: the model's own, capped at 8192)"})
    trust_remote_code: bool = field(default=False, metadata={"help": "let transformers run the model repo's own code"})
    num_threads: int | None = field(default=None, metadata={"help": "CPU threads for torch (default: torch's)"})
    seed: int = 0  # torch's global seed, for requests sampled without a seed of their own
    cache_dir: str | None = field(default=None, metadata={
        "help": "where tables and calibrations derived from the model are kept (default: $XDG_CACHE_HOME/specserve)"})
    weights: str = field(default="auto", metadata={"choices": WEIGHT_MODES, "help": (
        "how Linear layers keep their weights on the CPU: float32, bfloat16, int8 or int4 (weight-only kernels; "
        "a GGUF's 4-bit blocks map onto int4 directly), or gguf (each tensor in its GGUF block type, activations "
        "rounded to 8 bits, multiplied in integers as llama.cpp does; AVX512-VNNI or AVX2). auto: gguf for a "
        "quantised GGUF where the kernels run, else float32")})
    draft_model: str | None = field(default=None, metadata={"help": (
        "a draft model for --drafter draft / copyspec+draft: early-exit:N (the target's first N layers and its LM "
        "head, sharing its weights and KV), what --model takes (same vocabulary as the target), or a folder holding an "
        "EAGLE-3 head for the target (the public layout SpecForge, vLLM and SGLang use; `specserve train-draft`)")})
    companion_model: str | None = field(default=None, metadata={"help": (
        "Speculative Verification's companion (the same forms as --draft-model): scores each drafted token so that "
        "the goodput planner verifies the ones worth it; its table comes from `specserve calibrate sv`")})

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
    kv_cache_memory_gib: float = field(default=2.0, metadata={
        "flag": "--kv-cache-memory", "help": "GiB of memory for the paged KV pool, allocated at start-up"})
    block_size: int | None = field(default=None, metadata={
        "help": "positions per KV block (default: 16; 256 with flash-attn)"})
    attention_backend: str = field(default="auto", metadata={
        "help": "auto: flash where flash-attn is installed, else triton on CUDA, else sdpa (triton, flash: CUDA)",
        "choices": ATTENTION_BACKENDS})
    cuda_graph_max_tokens: int = field(default=256, metadata={
        "help": "on a GPU with the triton backend, steps of short chains (decoding, verifying chains of drafts) of "
                "up to this many tokens replay CUDA graphs captured at start-up; 0: every step eager"})

    def __post_init__(self) -> None:
        if self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib must be positive")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError("cuda_graph_max_tokens must be at least 0")
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

    def with_drafter(self, drafter: str, **spec) -> EngineConfig:
        """This config drafting with DRAFTER, SPEC replacing other speculation fields (a benchmark's variants)."""
        return replace(self, spec=replace(self.spec, drafter=drafter, **spec))
