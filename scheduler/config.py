"""Scheduling configuration: batch limits, the token budget and the goodput planner."""
from __future__ import annotations

from dataclasses import dataclass

SESSION_MODES = ("implicit", "explicit", "off")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 512  # tokens in one step's packed forward: prefill chunks, last tokens, drafts
    max_waiting: int = 256  # queued requests before new ones are refused
    use_goodput_planner: bool = True  # False: verify every drafted token the budget allows
    acceptance_prior: float = 0.5  # prior acceptance of a drafted token before any is observed
    acceptance_prior_weight: float = 4.0  # how many observations the prior is worth

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs: every running request advances each step")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must not be negative")
        if not 0.0 < self.acceptance_prior < 1.0:
            raise ValueError("acceptance_prior must lie strictly between 0 and 1")


@dataclass(frozen=True)
class SessionConfig:
    """Multi-turn session caches (scheduler/sessions.py)."""

    mode: str = "implicit"  # implicit: named sessions and longest cached prefix | explicit: named sessions only | off
    ttl_s: float = 600.0  # seconds a session stays cached after its last use
    max_sessions: int = 256  # sessions cached at once; the least recently used goes first
    host_memory_mib: float = 512.0  # host memory of cached sessions (histories, drafter states); LRU beyond it

    def __post_init__(self) -> None:
        if self.mode not in SESSION_MODES:
            raise ValueError(f"session mode must be one of {SESSION_MODES}, got {self.mode!r}")
        if self.ttl_s <= 0:
            raise ValueError("session ttl must be positive")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if self.host_memory_mib < 0:
            raise ValueError("session host memory must not be negative")
