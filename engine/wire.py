"""Typed messages between the server process and the engine process.

The engine sees token ids only; the server sees no tensors. Add fields only at
the end of a struct so that both sides stay compatible.
"""
from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class EngineRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    session_id: str | None = None


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str


class SpecStats(msgspec.Struct):
    num_drafts: int = 0  # verification rounds that carried at least one draft token
    num_draft_tokens: int = 0  # drafted tokens sent to verification
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class RequestOutput(msgspec.Struct):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    spec: SpecStats | None = None  # the request's running speculative totals
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from a session cache


class DraftStepStats(msgspec.Struct):
    """One drafter's speculation in one step."""

    num_drafts: int = 0  # requests that verified at least one of its drafted tokens
    num_draft_tokens: int = 0  # its drafted tokens that were verified
    num_accepted_tokens: int = 0
    num_accepted_per_position: list[int] = []  # [max verified position] accepted tokens at draft position i


class StepStats(msgspec.Struct):
    num_running: int = 0
    num_waiting: int = 0
    num_offered_draft_tokens: int = 0  # drafted tokens the drafters proposed this step
    num_verified_draft_tokens: int = 0  # of those, how many the planner sent to the forward
    num_accepted_tokens: int = 0
    step_seconds: float = 0.0
    spec_by_drafter: dict[str, DraftStepStats] = {}
    planned_tokens: float = 0.0  # tokens the planner expected this step to yield
    planned_seconds: float = 0.0  # seconds the latency model predicted for this step's forwards
    num_generated_tokens: int = 0  # tokens this step appended to its requests
    kv_cache_usage: float = 0.0  # fraction of the paged KV pool's blocks in use after the step
    num_scheduled_tokens: int = 0  # tokens in the step's packed forward: prefill chunks, last tokens, drafts
    num_preemptions: int = 0  # requests sent back to the waiting queue this step (recomputed later)
    session_hits: int = 0  # requests since the last step that found a cached session
    session_misses: int = 0  # requests since the last step that looked for a session and found none
    session_reused_tokens: int = 0  # their prompt tokens whose KV came from a session: prefill saved
    session_evictions: int = 0  # sessions evicted since the last step
    num_sessions: int = 0  # sessions cached after the step


class EngineOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[RequestOutput]
    stats: StepStats


class EngineReady(msgspec.Struct, tag="ready"):
    model_name: str
    max_model_len: int
    eos_token_ids: list[int]
    latency_ms_by_num_tokens: dict[int, float]  # profiled forward time for n tokens
    num_kv_blocks: int = 0  # blocks in the paged KV pool
    kv_block_size: int = 0  # positions per block


class EngineDead(msgspec.Struct, tag="dead"):
    reason: str


ToEngine = EngineRequest | AbortRequest
FromEngine = EngineOutputs | EngineReady | EngineDead
