"""Target distributions and lossless verification of drafted tokens.

Greedy: accept drafted tokens while they equal the argmax, then add the argmax
at the first mismatch (or after the last draft) as the bonus token.

Sampling with point-mass drafts (copied or n-gram tokens, q = δ_x): accept x with
probability p(x); on rejection sample from p with x removed and renormalised,
which is the residual (p - q)+ of speculative sampling for a point mass. p is the
distribution plain sampling draws from: temperature, then top-k, then top-p.
"""
from __future__ import annotations

import torch

from engine.wire import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature, top-k and top-p."""
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        scaled = _mask_top_p(scaled, params.top_p)
    return torch.softmax(scaled, dim=-1)


def _mask_top_p(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return scaled.masked_fill(remove, float("-inf"))


def verify_greedy(logits: torch.Tensor, draft_token_ids: list[int]) -> list[int]:
    """logits [k+1, vocab] at the last real token and each of the k drafts -> accepted drafts + bonus."""
    argmax = logits.argmax(dim=-1).tolist()  # [k+1]
    accepted = []
    for draft_id, target_id in zip(draft_token_ids, argmax):
        if draft_id != target_id:
            break
        accepted.append(draft_id)
    accepted.append(argmax[len(accepted)])
    return accepted


def verify_point_mass(probs: torch.Tensor, draft_token_ids: list[int], generator: torch.Generator | None) -> list[int]:
    """probs [k+1, vocab] -> accepted drafts + one token sampled from the target (or residual) distribution."""
    accepted = []
    uniforms = torch.rand(len(draft_token_ids), generator=generator).tolist()  # [k]
    for i, (draft_id, u) in enumerate(zip(draft_token_ids, uniforms)):
        if u >= probs[i, draft_id].item():
            residual = probs[i].clone()
            residual[draft_id] = 0.0
            return accepted + [_sample(residual, generator)]
        accepted.append(draft_id)
    return accepted + [_sample(probs[len(accepted)], generator)]


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from an unnormalised [vocab] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


class Verifier:
    """Verifies each request's drafts, keeping one random generator per seeded request."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def verify(self, request_id: str, params: SamplingParams, logits: torch.Tensor, draft_token_ids: list[int]) -> list[int]:
        if params.greedy:
            return verify_greedy(logits, draft_token_ids)
        probs = target_probs(logits, params)
        return verify_point_mass(probs, draft_token_ids, self._generator(request_id, params))

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None  # torch's global generator, seeded once at start-up
        if request_id not in self._generators:
            self._generators[request_id] = torch.Generator().manual_seed(params.seed)
        return self._generators[request_id]

    def finish(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
