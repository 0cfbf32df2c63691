"""The log-probabilities a request asked for: of each emitted token, and of its k most likely alternatives.

Which distribution (as vLLM's `processed_logprobs`, and what OpenAI describes): the one
the token was chosen from, after the request's penalties, logit bias, grammar mask
and temperature (1 when greedy), before top-k / top-p truncation, so that the
alternatives a sampler cut off still have their values. Tokens the grammar forbids
have probability 0; JSON has no -inf, so they report FORBIDDEN_LOGPROB, as vLLM does.
Only these few numbers leave the engine, never a row.
"""
from __future__ import annotations

import torch

from engine.wire import SamplingParams, TokenLogprob

FORBIDDEN_LOGPROB = -9999.0


def token_logprob(processed: torch.Tensor, token_id: int, params: SamplingParams) -> TokenLogprob:
    """processed [vocab] float32 logits (engine/logits_processing.py) -> the token's entry."""
    scaled = processed if params.greedy else processed / params.temperature
    logprobs = torch.log_softmax(scaled, dim=-1).clamp(min=FORBIDDEN_LOGPROB)
    top = torch.topk(logprobs, params.logprobs) if params.logprobs else None
    return TokenLogprob(
        token_id=token_id,
        logprob=float(logprobs[token_id]),
        top_token_ids=top.indices.tolist() if top is not None else [],
        top_logprobs=top.values.tolist() if top is not None else [],
    )
