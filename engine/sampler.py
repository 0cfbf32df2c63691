"""Target distributions and lossless verification of drafted tokens.

Greedy: accept drafted tokens while they equal the argmax, then add the argmax
at the first mismatch (or after the last draft) as the bonus token.

Sampling with point-mass drafts (copied or n-gram tokens, q = δ_x): accept x with
probability p(x); on rejection sample from p with x removed and renormalised,
which is the residual (p - q)+ of speculative sampling for a point mass. p is the
distribution plain sampling draws from: temperature, then top-k, then top-p. Both
are realised by sampling p itself at every position from that position's own
uniform (`verify_point_mass`), so seeded sampling does not depend on the drafts.
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


def verify_point_mass(probs: torch.Tensor, draft_token_ids: list[int], uniforms: list[float]) -> list[int]:
    """probs [k+1, vocab], uniforms [k+1] in (0, 1] -> accepted drafts + one token of the target distribution.

    Position i's token is the target's own sample, the inverse CDF of probs[i] at
    uniforms[i]; a drafted token is accepted when it is that sample. It is accepted
    with probability p(x), and a rejected draft is replaced by a sample of p with x
    removed and renormalised: the point-mass rule of speculative sampling, exactly.
    A position's token depends on its distribution and its uniform only, never on
    what was drafted, so a seeded request samples the same tokens with or without
    speculation.
    """
    sampled = inverse_cdf_samples(probs, uniforms)  # [k+1]
    accepted = []
    for draft_id, token_id in zip(draft_token_ids, sampled):
        if draft_id != token_id:
            break
        accepted.append(draft_id)
    accepted.append(sampled[len(accepted)])
    return accepted


def inverse_cdf_samples(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """probs [n, vocab] (unnormalised), uniforms [n] in (0, 1] -> [n] tokens, token i with probability probs[i, token].

    The first token whose cumulative mass reaches u * total: a token of zero mass never is.
    """
    cdf = probs[:len(uniforms)].double().cumsum(dim=-1)  # [n, vocab]
    targets = torch.tensor(uniforms, dtype=torch.float64)[:, None] * cdf[:, -1:]  # [n, 1]
    return torch.searchsorted(cdf, targets).clamp(max=probs.shape[-1] - 1)[:, 0].tolist()


class UniformStream:
    """One uniform in (0, 1] per output position of a request, in order, however many drafts each step verifies."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator  # None: torch's global generator
        self.pending: list[float] = []  # [drawn, not yet used] uniforms of the next output positions

    def next(self, num_positions: int) -> list[float]:
        """The uniforms of the next `num_positions` positions, drawn once each."""
        missing = num_positions - len(self.pending)
        if missing > 0:
            self.pending += (1.0 - torch.rand(missing, generator=self.generator, dtype=torch.float64)).tolist()
        return self.pending[:num_positions]

    def advance(self, num_positions: int) -> None:
        del self.pending[:num_positions]


class Verifier:
    """Verifies each request's drafts; sampled requests draw from one uniform stream each (seeded when asked)."""

    def __init__(self) -> None:
        self._streams: dict[str, UniformStream] = {}

    def verify(self, request_id: str, params: SamplingParams, logits: torch.Tensor, draft_token_ids: list[int]) -> list[int]:
        if params.greedy:
            return verify_greedy(logits, draft_token_ids)
        stream = self._stream(request_id, params)
        tokens = verify_point_mass(target_probs(logits, params), draft_token_ids, stream.next(len(draft_token_ids) + 1))
        stream.advance(len(tokens))
        return tokens

    def _stream(self, request_id: str, params: SamplingParams) -> UniformStream:
        if request_id not in self._streams:
            generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
            self._streams[request_id] = UniformStream(generator)
        return self._streams[request_id]

    def finish(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
