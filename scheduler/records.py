"""The scheduler's plain records: what one step schedules, what verification reports back, and the statistics.

Plain data, no tensors and nothing of `engine/`: the engine reads these and turns
them into forward items and wire messages (the statistics travel as they are).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.request import Request  # type-only: scheduler.request imports this module (an import circle)


@dataclass
class ScheduledRequest:
    """One request's part of a step: the tokens its forward carries and where their KV lives."""

    req: Request
    token_ids: list[int]  # [num_real + num_draft] uncomputed tokens of the request, then the selected draft nodes
    num_computed: int  # KV positions already computed before this step
    block_table: list[int]  # the request's KV blocks; KV index i lives in block_table[i // block_size]
    reaches_end: bool = True  # False for a prefill chunk that stops short of the request's last token
    draft_nodes: list[int] = field(default_factory=list)  # [num_draft] indices into req.draft of the verified nodes
    # [num_draft] parent of each within the selection, -1 = last token
    draft_parents: list[int] = field(default_factory=list)
    # the first chains of req.draft.lookahead the forward carries after the draft nodes (not in token_ids)
    lookahead: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def num_lookahead_rows(self) -> int:
        return sum(len(chain) for chain in self.lookahead)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_nodes)

    @property
    def num_real_tokens(self) -> int:
        return len(self.token_ids) - self.num_draft_tokens

    @property
    def is_prefill(self) -> bool:
        return not self.reaches_end or self.num_real_tokens > 1

    @property
    def num_logits(self) -> int:
        """Rows whose next-token distribution the verifier needs: the last real token and each draft node."""
        return self.num_draft_tokens + 1 if self.reaches_end else 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[self.num_real_tokens:]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # sent back to the waiting queue this step
    num_offered_draft_tokens: int = 0
    offers_rows: bool = False  # some request offered drafted or look-ahead rows (the planner may have declined them)
    num_verified_draft_tokens: int = 0
    expected_tokens: float = 0.0  # the planner's estimate of the tokens this step yields
    predicted_seconds: float = 0.0  # the latency model's estimate of this step's forward

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(item.token_ids) + item.num_lookahead_rows for item in self.scheduled)

    @property
    def num_lookahead_rows(self) -> int:
        return sum(item.num_lookahead_rows for item in self.scheduled)

    @property
    def has_prefill(self) -> bool:
        return any(item.is_prefill for item in self.scheduled)


@dataclass
class Verification:
    """What verifying one scheduled request produced."""

    token_ids: list[int]  # accepted draft tokens, then the one token the target chose after them ([] short of the end)
    # [num accepted] indices into the item's draft selection, root first
    accepted_nodes: list[int] = field(default_factory=list)


@dataclass
class SpecStats:
    """A request's running speculative totals."""

    num_drafts: int = 0  # verification rounds that carried at least one draft token
    num_draft_tokens: int = 0  # drafted tokens sent to verification
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class DraftStepStats:
    """One drafter's speculation in one step."""

    num_drafts: int = 0  # requests that verified at least one of its drafted tokens
    num_draft_tokens: int = 0  # its drafted tokens that were verified
    num_accepted_tokens: int = 0
    # [max depth] accepted tokens at draft depth i + 1
    num_accepted_per_position: list[int] = field(default_factory=list)
    num_accepted_per_rank: list[int] = field(default_factory=list)  # [max rank] accepted tokens of sibling rank i


@dataclass
class RequestUpdate:
    """What one step did to a request that reached its end this step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while it runs
    num_prompt_tokens: int
    spec: SpecStats
    num_cached_tokens: int  # prompt tokens whose KV came from a session cache


@dataclass
class StepStats:
    num_running: int = 0
    num_waiting: int = 0
    num_offered_draft_tokens: int = 0  # drafted tokens the drafters proposed this step
    num_verified_draft_tokens: int = 0  # of those, how many the planner sent to the forward
    num_accepted_tokens: int = 0
    step_seconds: float = 0.0
    spec_by_drafter: dict[str, DraftStepStats] = field(default_factory=dict)
    planned_tokens: float = 0.0  # tokens the planner expected this step to yield
    planned_seconds: float = 0.0  # seconds the latency model predicted for this step's forwards
    num_generated_tokens: int = 0  # tokens this step appended to its requests
    # drafter -> 'greedy' or 'sampled' -> the factor the planner multiplies its acceptance estimates by
    acceptance_calibration: dict[str, dict[str, float]] = field(default_factory=dict)
    kv_cache_usage: float = 0.0  # fraction of the paged KV pool's blocks in use after the step
    num_scheduled_tokens: int = 0  # tokens in the step's packed forward: prefill chunks, last tokens, drafts
    num_lookahead_rows: int = 0  # of those, look-ahead rows (drafters/spectra.py's candidate pool)
    num_preemptions: int = 0  # requests sent back to the waiting queue this step (recomputed later)
    session_hits: int = 0  # requests since the last step that found a cached session
    session_misses: int = 0  # requests since the last step that looked for a session and found none
    session_reused_tokens: int = 0  # their prompt tokens whose KV came from a session: prefill saved
    session_evictions: int = 0  # sessions evicted since the last step
    conversation_hits: dict[str, int] = field(default_factory=dict)  # by kind: later turns continued from a session
    conversation_misses: dict[str, int] = field(default_factory=dict)  # by kind: later turns that found none
    num_sessions: int = 0  # sessions cached after the step
    drafter_state_bytes: int = 0  # memory of drafter states (live requests and cached sessions) after the step
    session_host_bytes: int = 0  # host memory of cached sessions (histories, block lists, their drafter states)


@dataclass
class StepUpdate:
    """What `Scheduler.update` returns: per request that reached its end, its update; the step's stats; and
    the KV the engine must move so that each accepted draft branch sits at its final positions."""

    updates: list[RequestUpdate]
    stats: StepStats
    kv_moves: list[tuple[int, int]] = field(default_factory=list)  # (from slot, to slot) pairs, applied in order
