"""What a request does to the target's logits before a token is chosen: penalties, logit bias, its grammar's mask.

Verification applies exactly this at every position it walks, drafted or not, with
the tokens emitted earlier in the same walk counted as generated (they are, by the
time plain decoding would reach that position), so a drafted token is judged by the
distribution plain decoding would sample from there. Definitions:

- presence / frequency penalty (OpenAI): logit[t] -= presence * [c_t > 0] + frequency * c_t,
  c_t the count of t among the generated tokens (not the prompt's);
- repetition penalty (CTRL, as transformers and vLLM apply it): a token in the prompt or
  the generated tokens has its logit divided by r when positive, multiplied when not;
- logit bias (OpenAI): added to the token's logit, after the penalties;
- the grammar (engine/grammar.py): tokens it forbids get -inf, last.
"""
from __future__ import annotations

from collections import Counter

import torch

from engine.grammar import Grammars
from engine.wire import SamplingParams
from scheduler.request import Request


class LogitsProcessor:
    """One request's processing for one verification walk: `apply` per position, `emit` per chosen token.

    Penalties touch only the tokens that occurred (a few hundred of a vocabulary of tens of thousands), kept as a
    Counter and a set rather than vocabulary-sized tensors."""

    def __init__(self, req: Request, grammars: Grammars) -> None:
        self.params: SamplingParams = req.sampling
        self.request_id = req.request_id
        self.grammars = grammars if grammars.has(req.request_id) else None
        self.generated = Counter(req.all_token_ids[req.num_prompt_tokens:]) if _penalises_counts(self.params) else None
        self.seen = set(req.all_token_ids) if self.params.repetition_penalty != 1.0 else None
        self.bias_ids, self.bias_values = _bias_tensors(self.params.logit_bias)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[vocab] raw logits at the walk's current position -> float32 processed logits."""
        processed = logits.float().clone()
        if self.seen:
            _apply_repetition_penalty(processed, self.seen, self.params.repetition_penalty)
        if self.generated:
            _apply_count_penalties(processed, self.generated, self.params)
        if self.bias_ids is not None:
            processed.index_add_(0, self.bias_ids, self.bias_values)
        if self.grammars is not None:
            processed.masked_fill_(~self.grammars.allowed(self.request_id), float("-inf"))
        return processed

    def emit(self, token_id: int) -> None:
        """The walk chose TOKEN_ID: later positions count it, and the grammar consumes it."""
        if self.generated is not None:
            self.generated[token_id] += 1
        if self.seen is not None:
            self.seen.add(token_id)
        if self.grammars is not None:
            self.grammars.consume(self.request_id, token_id)


def _penalises_counts(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty)


def _apply_repetition_penalty(logits: torch.Tensor, seen: set[int], penalty: float) -> None:
    """Seen tokens' positive logits divided by PENALTY, negative ones multiplied; kept finite, so that an extreme
    penalty the API accepts (any > 0: 5e-324 is 0 in float32) cannot make the distribution NaN."""
    ids = torch.tensor(list(seen), dtype=torch.long)
    values = logits[ids]
    logits[ids] = torch.where(values > 0, values / penalty, values * penalty).nan_to_num()  # ±inf -> the dtype's limits


def _apply_count_penalties(logits: torch.Tensor, generated: Counter, params: SamplingParams) -> None:
    ids = torch.tensor(list(generated), dtype=torch.long)
    counts = torch.tensor(list(generated.values()), dtype=torch.float32)
    logits.index_add_(0, ids, -(params.frequency_penalty * counts + params.presence_penalty))


def _bias_tensors(logit_bias: dict[int, float]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if not logit_bias:
        return None, None
    ids = torch.tensor(list(logit_bias), dtype=torch.long)
    return ids, torch.tensor(list(logit_bias.values()), dtype=torch.float32)
