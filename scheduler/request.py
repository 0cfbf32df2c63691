"""A request's state as the scheduler keeps it: plain data, no tensors."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from drafters.base import Draft
from scheduler.records import SpecStats


class StopParams(Protocol):
    """What the scheduler reads of a request's sampling parameters (the engine's SamplingParams have these)."""

    max_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    temperature: float  # 0: greedy


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: StopParams
    session_id: str | None = None
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output, grows as tokens are accepted
    num_computed_tokens: int = 0  # positions whose KV is in the cache
    num_cached_tokens: int = 0  # prompt positions whose KV a session cache supplied (prefill saved)
    draft: Draft | None = None  # proposed for the next step
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    arrival_time: float = field(default_factory=time.monotonic)  # seconds, monotonic clock
    prompt_source: str | None = None  # an earlier choice of the same request (same prompt) whose prompt KV it reads
    continues: bool = False  # a later turn of a conversation: counted as a session hit or miss (scheduler/sessions.py)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def max_new_tokens_left(self) -> int:
        return self.sampling.max_tokens - self.num_output_tokens

    @property
    def sampled(self) -> bool:
        """Whether the request samples its tokens (not greedy)."""
        return self.sampling.temperature > 0

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Running with only its last token uncomputed: the state in which it verifies drafts."""
        return self.status is RequestStatus.RUNNING and self.num_uncomputed_tokens == 1
