"""Typed messages between the server process and the engine process.

The engine sees token ids only; the server sees no tensors. Add fields only at
the end of a struct so that both sides stay compatible. The step statistics are the
scheduler's own plain records (scheduler/records.py), which msgspec encodes as they are.
"""
from __future__ import annotations

from typing import Literal

import msgspec

from scheduler.records import DraftStepStats, SpecStats, StepStats  # the scheduler's own records travel as they are

__all__ = ["DraftStepStats", "SpecStats", "StepStats"]  # re-exported for the server, which reads them


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    # CTRL / transformers: logits of prompt or generated tokens divided (>0) or multiplied
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    # None: off; k >= 0: each emitted token's log-probability and its k most likely alternatives
    logprobs: int | None = None
    # an llguidance grammar (JSON) every emitted token must follow (structured outputs, tools)
    grammar: str | None = None
    # None: off; k >= 0: each prompt token's log-probability under the model (the first's is None) and its k most
    # likely alternatives, the whole prompt computed afresh (no cached prefix is read)
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether the target's logits change before sampling (penalties, bias, a grammar)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
            or self.grammar
        )


class EngineRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    session_id: str | None = None
    prompt_source: str | None = None  # an earlier choice of the same request (same prompt): its prompt KV is shared
    continues: bool = False  # a later turn of a conversation (its messages hold an earlier reply)


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str


class EngineError(msgspec.Struct):
    """Why the engine refused a request (the engine itself is fine)."""

    kind: Literal["queue_full", "invalid_request"]
    message: str


class TokenLogprob(msgspec.Struct, array_like=True):
    """One emitted token's log-probability and its most likely alternatives (engine/logprobs.py says which
    distribution)."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int = 0  # the token's rank in its distribution (1 = most likely); 0 where not computed (emitted tokens)


class RequestOutput(msgspec.Struct):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    spec: SpecStats | None = None  # the request's running speculative totals
    error: EngineError | None = None  # set when finish_reason is "error"
    num_cached_tokens: int = 0  # prompt tokens whose KV came from a session cache
    logprobs: list[TokenLogprob] | None = None  # [len(new_token_ids)] when the request asked for logprobs
    # [num_prompt_tokens] with the output that completes the prompt, when the request asked (entry 0 is None)
    prompt_logprobs: list[TokenLogprob | None] | None = None


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
    weights: str = ""  # how the Linear layers keep their weights: float32, bfloat16, int8 or int4
    vocab_size: int = 0  # the model's logits width: token ids a request may name lie below it


class EngineDead(msgspec.Struct, tag="dead"):
    reason: str


ToEngine = EngineRequest | AbortRequest
FromEngine = EngineOutputs | EngineReady | EngineDead
