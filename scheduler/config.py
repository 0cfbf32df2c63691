"""Scheduling configuration: batch limits, the token budget, the goodput planner and session caches.

A field with a "help" in its metadata is also a command-line flag (server/flags.py makes them)."""
from __future__ import annotations

from dataclasses import dataclass, field

SESSION_MODES = ("implicit", "explicit", "off")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata={"help": "requests running at once"})
    max_num_batched_tokens: int = field(default=512, metadata={
        "help": "token budget of one step: prefill chunks, last tokens and drafts"})
    max_waiting: int = field(default=256, metadata={"help": "queued requests before new ones get 429"})
    use_goodput_planner: bool = field(default=True, metadata={
        "flag": "--no-goodput-planner", "help": "verify every drafted token the budget allows"})
    acceptance_prior: float = 0.5  # prior acceptance of a drafted token before any is observed
    acceptance_prior_weight: float = 4.0  # how many observations the prior is worth

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs: "
                             "every running request advances each step")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must not be negative")
        if not 0.0 < self.acceptance_prior < 1.0:
            raise ValueError("acceptance_prior must lie strictly between 0 and 1")


@dataclass(frozen=True)
class SessionConfig:
    """Multi-turn session caches (scheduler/sessions.py)."""

    mode: str = field(default="implicit", metadata={"flag": "--session-mode", "choices": SESSION_MODES, "help": (
        "multi-turn session caches: implicit (X-Session-ID / session_id, else the longest cached prefix), "
        "explicit (named sessions only) or off")})
    ttl_s: float = field(default=600.0, metadata={
        "flag": "--session-ttl", "help": "seconds a session stays cached after its last use"})
    max_sessions: int = field(default=256, metadata={"help": "sessions cached at once (least recently used go first)"})
    host_memory_mib: float = field(default=512.0, metadata={"flag": "--session-host-memory", "help": (
        "MiB of host memory for cached sessions (histories, drafter states); least recently used go first")})

    def __post_init__(self) -> None:
        if self.mode not in SESSION_MODES:
            raise ValueError(f"session mode must be one of {SESSION_MODES}, got {self.mode!r}")
        if self.ttl_s <= 0:
            raise ValueError("session ttl must be positive")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if self.host_memory_mib < 0:
            raise ValueError("session host memory must not be negative")
