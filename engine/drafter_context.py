"""What a drafter's builder is given (drafters/base.py's DrafterContext), made from the loaded target.

Model-derived tables are named by a fingerprint of the served weights (not of a path),
so the same weights find their tables wherever they were loaded from, and weights
served at another precision get tables of their own.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from drafters.base import DrafterContext
from engine.config import ModelConfig
from engine.forward import ForwardBatch, ForwardItem
from engine.model_loader import LoadedModel
from engine.packed_runner import PackedModelRunner
from engine.paged_attention import PagedKVPool, kv_shape

SINGLE_TOKEN_BATCH = 256  # bare tokens per forward of `next_token_logits`, and slots of its scratch pool
FINGERPRINT_STRIDE = 97  # every 97th row of the output embedding enters the fingerprint


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specserve"


def drafter_context(loaded: LoadedModel, config: ModelConfig) -> DrafterContext:
    model_config = loaded.model.config
    return DrafterContext(
        model_fingerprint=weights_fingerprint(loaded.model),
        vocab_size=model_config.vocab_size,
        num_layers=model_config.num_hidden_layers,
        cache_dir=Path(config.cache_dir) if config.cache_dir else default_cache_dir(),
        next_token_logits=SingleTokenForward(loaded),
    )


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """16 hex digits naming the served weights: the config, the dtype and a sample of the output embedding."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    weight = model.get_output_embeddings().weight
    digest.update(str(weight.dtype).encode())
    digest.update(weight[::FINGERPRINT_STRIDE].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class SingleTokenForward:
    """[B] bare tokens -> [B, vocab] logits of a one-token forward of the target on each (no BOS, no context).

    Runs the target's own weights through a runner of its own with a scratch pool of SINGLE_TOKEN_BATCH slots,
    so it may run in a background thread beside the engine's steps.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        layers, kv_heads, head_dim = kv_shape(loaded.model.config)
        dtype = next(loaded.model.parameters()).dtype
        pool = PagedKVPool(layers, SINGLE_TOKEN_BATCH, kv_heads, head_dim, dtype, loaded.device)
        self.runner = PackedModelRunner(loaded.model, loaded.device, pool, block_size=1)

    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        logits = []
        for start in range(0, len(token_ids), SINGLE_TOKEN_BATCH):
            chunk = token_ids[start:start + SINGLE_TOKEN_BATCH]
            items = [ForwardItem([token], [0], [slot], [slot], 0, logit_rows=[0]) for slot, token in enumerate(chunk)]
            logits += self.runner.execute(ForwardBatch(items)).logits
        return torch.cat(logits)


def build_model_tables(config: ModelConfig) -> dict[str, Path]:
    """Load the model and build every table drafters derive from it (the model bigram), or find it cached."""
    from drafters.registry import model_bigram
    from engine.model_loader import load_model

    loaded = load_model(config)
    table = model_bigram(drafter_context(loaded, config))
    if table.wait() is None:
        raise RuntimeError("building the model bigram table failed (see the log)")
    return {"bigram": table.path}
