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


def prompt_token_logprobs(logits: torch.Tensor, next_token_ids: list[int], k: int) -> list[TokenLogprob]:
    """logits [rows, vocab] of consecutive prompt positions, on the device -> each row's entry for the prompt token
    that follows it, with the K most likely alternatives. The model's raw distribution: a prompt token was not
    sampled, so no penalty, bias, grammar or temperature applies (vLLM's prompt_logprobs; lm-eval's hf backend).
    Reduced where the logits are: only the entries travel to the host."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    token_ids = torch.tensor(next_token_ids, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_ids = top_values = [[]] * len(next_token_ids)
    if k:
        top = torch.topk(logprobs, k, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [TokenLogprob(*entry) for entry in zip(next_token_ids, chosen[:, 0].tolist(), top_ids, top_values, ranks)]


class PromptLogprobs:
    """The prompt log-probabilities of the requests that asked, gathered chunk by chunk as their prefill computes
    them, and handed out once, with the output of the step that completes the prompt.

    Row r of a prefill chunk after c computed positions scores prompt token c + r + 1. A request that asks reads no
    cached prefix (engine/engine.py), so every prompt position is computed here and the figures never depend on what
    a session or another choice had cached; a preempted request recomputes its rows, which overwrite the same
    entries."""

    def __init__(self) -> None:
        self._entries: dict[str, list[TokenLogprob | None]] = {}

    def begin(self, request_id: str, num_prompt_tokens: int) -> None:
        self._entries[request_id] = [None] * num_prompt_tokens

    def rows(self, request_id: str, num_computed: int, num_real_tokens: int) -> list[int]:
        """Rows of a chunk starting after NUM_COMPUTED positions whose logits score a prompt token."""
        entries = self._entries.get(request_id)
        if entries is None:
            return []
        return list(range(max(0, min(num_real_tokens, len(entries) - 1 - num_computed))))

    def record(self, request_id: str, num_computed: int, logits: torch.Tensor, prompt: list[int], k: int) -> None:
        entries = self._entries[request_id]
        first = num_computed + 1
        entries[first:first + len(logits)] = prompt_token_logprobs(logits, prompt[first:first + len(logits)], k)

    def take(self, request_id: str) -> list[TokenLogprob | None] | None:
        return self._entries.pop(request_id, None)

    def finish(self, request_id: str) -> None:
        self._entries.pop(request_id, None)
