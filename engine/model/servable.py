"""Whether specserve serves a model correctly: a model whose attention it cannot reproduce is refused at start-up,
with the reason, rather than served wrong.

Every forward runs the model's layers with attention through the paged KV pool (engine/model/paged_attention.py),
which applies a causal mask, a tree's ancestor mask and a per-layer sliding window, and nothing else. A model whose
attention needs more (soft-capped attention scores, bidirectional or chunked attention, layers that are not
attention at all), or whose modules do not attend through transformers' attention interface at all, would be
computed with the wrong keys or the wrong scores: `refusal` names what is missing.
"""
from __future__ import annotations

import torch

from engine.model.decoder import supports

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


def refusal(model: torch.nn.Module) -> str | None:
    """Why MODEL cannot be served correctly, or None where it can."""
    reason = config_refusal(model.config)
    if reason is None and not supports(model) and not getattr(model, "_supports_attention_backend", False):
        reason = (f"its attention ({type(model).__name__}) does not run through transformers' attention interface, "
                  "so it cannot read its keys from the paged KV pool")
    return reason


def config_refusal(config) -> str | None:
    """What of a transformers config's attention the paged attention cannot apply, or None: checked before the
    weights load (transformers itself refuses some of these models with a message about SDPA)."""
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; specserve serves decoder-only models"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "it soft-caps its attention scores (attn_logit_softcapping), which the paged attention does not apply"
    if getattr(config, "use_bidirectional_attention", False):
        return "its layers attend bidirectionally; the paged attention is causal"
    if getattr(config, "attention_chunk_size", None) is not None:
        return "it attends in chunks (attention_chunk_size), which the paged attention does not apply"
    other = set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES
    if other:
        return f"it has layers of type {sorted(other)}; the paged attention serves {sorted(ATTENTION_LAYER_TYPES)}"
    return None


def check_servable(reason: str | None, name: str) -> None:
    """Raise a ValueError saying why NAME cannot be served correctly, if REASON says it cannot."""
    if reason is not None:
        raise ValueError(f"specserve cannot serve {name} correctly: {reason}")
