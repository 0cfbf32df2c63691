"""A request's state as the scheduler keeps it: plain data, no tensors."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.wire import SamplingParams, SpecStats


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    session_id: str | None = None
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output, grows as tokens are accepted
    num_computed_tokens: int = 0  # positions whose KV is in the cache
    num_cached_tokens: int = 0  # prompt positions whose KV a session cache supplied (prefill saved)
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step
    draft_source: str = ""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    num_accepted_by_position: list[int] = field(default_factory=list)  # [max draft position] this request's accepts
    num_offered_by_position: list[int] = field(default_factory=list)  # [max draft position] its verified drafts
    num_steps_unverified: int = 0  # steps in a row that offered drafts and verified none
    arrival_time: float = field(default_factory=time.monotonic)  # seconds, monotonic clock

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
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
