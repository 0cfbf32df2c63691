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
FINGERPRINT_STRIDE = 97  # every 97th row of the token embedding enters the fingerprint


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specserve"


def drafter_context(loaded: LoadedModel, config: ModelConfig) -> DrafterContext:
    from engine.calibration import PldPlusCalibration, calibration_path

    model_config = loaded.model.config
    fingerprint = weights_fingerprint(loaded.model, loaded.weights)
    cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    return DrafterContext(
        model_fingerprint=fingerprint,
        vocab_size=model_config.vocab_size,
        num_layers=model_config.num_hidden_layers,
        cache_dir=cache_dir,
        next_token_logits=SingleTokenForward(loaded),
        pld_plus_calibration=PldPlusCalibration.load(calibration_path(cache_dir, fingerprint)),
    )


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module, weights: str) -> str:
    """16 hex digits naming the served weights: the config, how the Linear layers keep them (engine/weights.py),
    the dtype and a sample of the token embedding."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    weight = model.get_input_embeddings().weight
    digest.update(f"{weights} {weight.dtype}".encode())
    digest.update(weight[::FINGERPRINT_STRIDE].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class SingleTokenForward:
    """[B] tokens -> [B, vocab] logits of the target at each token, seen right after the model's BOS token only.

    The learning-free n-gram paper's code runs the bare token at position 0. We put the BOS token first (when the
    model has one): a small model's first position is an attention sink whose predictions ignore the token —
    SmolLM2-135M predicts "-" "," "_" after every bare token (top-1 right on 0.3% of 1,500 pairs of its own greedy
    output, top-10 on 24.7%), and 15.5% and 38.5% after BOS — and in serving the model never runs without it.

    Runs the target's own weights through a runner of its own with a scratch pool (the BOS token's KV at slot 0,
    shared by every row; one slot per row after it), so it may run in a background thread beside the engine's steps.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        layers, kv_heads, head_dim = kv_shape(loaded.model.config)
        dtype = next(loaded.model.parameters()).dtype
        pool = PagedKVPool(layers, SINGLE_TOKEN_BATCH + 1, kv_heads, head_dim, dtype, loaded.device)
        self.runner = PackedModelRunner(loaded.model, loaded.device, pool, block_size=1)
        self.bos_token_id = loaded.model.config.bos_token_id
        if self.bos_token_id is not None:
            self.runner.execute(ForwardBatch([ForwardItem([self.bos_token_id], [0], [0], [0], 0)]))

    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        logits = []
        for start in range(0, len(token_ids), SINGLE_TOKEN_BATCH):
            chunk = token_ids[start:start + SINGLE_TOKEN_BATCH]
            logits += self.runner.execute(ForwardBatch([self._item(token, slot) for slot, token in enumerate(chunk, 1)])).logits
        return torch.cat(logits)

    def _item(self, token: int, slot: int) -> ForwardItem:
        if self.bos_token_id is None:
            return ForwardItem([token], [0], [slot], [slot], 0, logit_rows=[0])
        return ForwardItem([token], [1], [slot], [0, slot], 1, logit_rows=[0])  # KV index 0 is the shared BOS


def build_model_tables(config: ModelConfig) -> dict[str, Path]:
    """Load the model and build every table drafters derive from it (the model bigram), or find it cached."""
    from drafters.registry import model_bigram
    from engine.model_loader import load_model

    loaded = load_model(config)
    table = model_bigram(drafter_context(loaded, config))
    if table.wait() is None:
        raise RuntimeError("building the model bigram table failed (see the log)")
    return {"bigram": table.path}
