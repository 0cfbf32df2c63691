"""The distribution plain sampling draws from, and the uniforms that realise it.

p is temperature, then top-k, then top-p over the target's logits. A sample is the
inverse CDF of p at a uniform; each output position of a request has its own uniform,
drawn once, so seeded sampling does not depend on how many drafts a step verified
(engine/verifier.py).
"""
from __future__ import annotations

import torch

from engine.model.cpu_kernels import fused_ops_available
from engine.wire import SamplingParams

UNIFORM_CHUNK = 64  # uniforms a stream draws at a time
ARGMAX_SLICES = 512  # a large vocabulary's argmax in two stages: the largest logit of each slice, then the first


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    return greedy_token_tensor(logits).tolist()


def greedy_token_tensor(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the first index of its largest logit. Float32 rows on the CPU take the fused kernel
    (engine/model/csrc/fused_ops.cpp `argmax_rows`: ~6 us a 49,152-token row where torch's argmax takes ~60, a tenth
    of what a verified row costs the embedded model). Elsewhere, over a vocabulary of many slices (Gemma's 262,144 =
    512 x 512) it runs in two stages, each slice's largest logit and then the first slice holding the row's largest,
    which gives the same index in a quarter of one argmax's time on the CPU."""
    rows, vocab = logits.shape
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and vocab and fused_ops_available():
        return torch.ops.specserve.argmax_rows(logits if logits.stride(-1) == 1 else logits.contiguous())
    if vocab % ARGMAX_SLICES or vocab < ARGMAX_SLICES * ARGMAX_SLICES:
        return logits.argmax(dim=-1)
    values, within = logits.view(rows, ARGMAX_SLICES, -1).max(dim=-1)  # per slice: largest, its first index
    first_slice = values.argmax(dim=-1)  # the first slice holding the row's largest logit
    return first_slice * (vocab // ARGMAX_SLICES) + within.gather(1, first_slice[:, None])[:, 0]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] float32 probabilities after temperature, top-k and top-p."""
    scaled = logits.float()
    if params.temperature != 1.0:  # x / 1 is x: one tensor operation fewer on every sampled row
        scaled = scaled / params.temperature
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


def sample_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: list[float]) -> list[int]:
    """logits [n, vocab], uniforms [n] in (0, 1] -> [n] tokens drawn from `target_probs` by the inverse CDF, each at
    its uniform. Float32 logits on the CPU without top-k or top-p take the fused kernel (engine/model/csrc/
    fused_ops.cpp `sample_rows`, ~30 us a 49,152-token row against ~100 us for softmax, cumulative sum and search
    here); its exp and sums round differently, so a uniform within float rounding of a boundary between two tokens
    may give the other one."""
    if _samples_fused(logits, params):
        return torch.ops.specserve.sample_rows(logits, 1.0 / params.temperature, uniforms).tolist()
    return inverse_cdf_samples(target_probs(logits, params), uniforms)


def _samples_fused(logits: torch.Tensor, params: SamplingParams) -> bool:
    plain = not 0 < params.top_k < logits.shape[-1] and params.top_p >= 1.0
    return plain and logits.device.type == "cpu" and logits.dtype == torch.float32 and fused_ops_available()


def inverse_cdf_samples(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """probs [n, vocab] (unnormalised), uniforms [n] in (0, 1] -> [n] tokens, token i with probability probs[i, token].

    The first token whose cumulative mass (summed in float64) reaches u * total: a token of zero mass never is. Row by
    row on the host, in as few tensor operations as it takes: between forwards each one costs tens of microseconds.
    """
    samples = []
    for row, uniform in zip(probs, uniforms):
        cdf = row.cumsum(dim=-1, dtype=torch.float64)  # [vocab]
        samples.append(min(int(torch.searchsorted(cdf, uniform * float(cdf[-1]))), len(cdf) - 1))
    return samples


def inverse_cdf_tensor(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """`inverse_cdf_samples` as a tensor on PROBS' device, all rows at once (one transfer of the tokens)."""
    cdf = probs[:len(uniforms)].cumsum(dim=-1, dtype=torch.float64)  # [n, vocab]
    targets = torch.tensor(uniforms, dtype=torch.float64, device=probs.device)[:, None] * cdf[:, -1:]  # [n, 1]
    return torch.searchsorted(cdf, targets).clamp(max=probs.shape[-1] - 1)[:, 0]


class UniformStream:
    """One uniform in (0, 1] per output position of a request, in order, however many drafts each step verifies."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator  # None: torch's global generator
        self.pending: list[float] = []  # [drawn, not yet used] uniforms of the next output positions

    def next(self, num_positions: int) -> list[float]:
        """The uniforms of the next `num_positions` positions, drawn once each."""
        missing = num_positions - len(self.pending)
        if missing > 0:  # drawn ahead in chunks: the same sequence as one at a time, in fewer tensor operations
            drawn = torch.rand(max(missing, UNIFORM_CHUNK), generator=self.generator, dtype=torch.float64).tolist()
            self.pending += [1.0 - u for u in drawn]
        return self.pending[:num_positions]

    def advance(self, num_positions: int) -> None:
        del self.pending[:num_positions]
