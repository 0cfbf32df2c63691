"""Losslessness check: outputs must match the baseline, except at a genuine near-tie.

Floating-point sums differ between a 1-token and a k-token forward, so greedy
outputs may legitimately part where the reference's top-2 logits (nearly) tie.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

NEAR_TIE_LOGIT_GAP = 1e-3  # largest top-2 logit gap at which a divergence is accepted


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@contextmanager
def plain_attention(model: torch.nn.Module):
    """Run the model with transformers' own SDPA attention, whatever the engine registered for its packed forwards."""
    previous = model.config._attn_implementation
    if previous != "sdpa":
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if previous != "sdpa":
            model.set_attn_implementation(previous)


@torch.inference_mode()
def top2_logit_gap(model: torch.nn.Module, token_ids: list[int]) -> float:
    """Gap between the two largest next-token logits after `token_ids`, from one plain forward."""
    device = next(model.parameters()).device
    with plain_attention(model):
        logits = model(input_ids=torch.tensor([token_ids], device=device), logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def divergence_verdict(model: torch.nn.Module, prompt_ids: list[int], reference: list[int], other: list[int]) -> str:
    """'identical', 'near-tie' (allowed) or 'mismatch' (a losslessness bug)."""
    i = first_difference(reference, other)
    if i is None:
        return "identical"
    if i >= min(len(reference), len(other)):
        return "mismatch"  # one stopped early: not a tie between two tokens
    gap = top2_logit_gap(model, prompt_ids + reference[:i])
    return "near-tie" if gap < NEAR_TIE_LOGIT_GAP else "mismatch"
