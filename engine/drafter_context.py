"""What a drafter's builder is given (drafters/base.py's DrafterContext), made from the loaded target, the
models the engine lends its drafter, and the calibration artifacts found for them (engine/artifacts.py)."""
from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

import torch

from drafters.base import DrafterContext
from drafters.model_ngrams import ModelNgrams
from engine.artifacts import (
    CORPUS_RECIPE,
    PldPlusCalibration,
    SpectraCorpus,
    calibration_path,
    corpus_path,
    default_cache_dir,
    load_sv_tables,
    sv_fingerprints,
    weights_fingerprint,
)
from engine.config import ModelConfig
from engine.model.cuda_graphs import CAPTURE_LOCK
from engine.model.draft_model import DraftForward
from engine.model.forward import ForwardBatch, ForwardItem
from engine.model.model_loader import LoadedModel
from engine.model.packed_runner import PackedModelRunner
from engine.model.paged_attention import PagedKVPool, kv_shape

logger = logging.getLogger("specserve.engine")

SINGLE_TOKEN_BATCH = 256  # bare tokens per forward of `next_token_logits`, and slots of its scratch pool


def drafter_context(
    loaded: LoadedModel, config: ModelConfig,
    draft_forward: DraftForward | None = None, companion_forward: DraftForward | None = None,
) -> DrafterContext:
    """The context of LOADED's drafter; SV's tables are looked up when the engine owns both a draft and a companion."""
    model_config = loaded.model.config
    fingerprint = weights_fingerprint(loaded.model, loaded.weights)
    cache_dir = model_cache_dir(config)
    corpus = load_corpus(corpus_path(cache_dir, fingerprint))
    sv_tables = {}
    if draft_forward and companion_forward:
        sv_tables = load_sv_tables(cache_dir, sv_fingerprints(fingerprint, draft_forward, companion_forward))
    return DrafterContext(
        model_fingerprint=fingerprint,
        vocab_size=model_config.vocab_size,
        num_layers=model_config.num_hidden_layers,
        cache_dir=cache_dir,
        next_token_logits=SingleTokenForward(loaded),
        pld_plus_calibration=PldPlusCalibration.load(calibration_path(cache_dir, fingerprint)),
        draft_forward=draft_forward,
        companion_forward=companion_forward,
        sv_tables=sv_tables,
        spectra_corpus=corpus.documents if corpus else None,
        model_ngrams=ModelNgrams.from_json(corpus.model_ngrams) if corpus and corpus.model_ngrams else None,
    )


def load_corpus(path: Path) -> SpectraCorpus | None:
    """The SPECTRA corpus at PATH, if calibrated; one an earlier recipe made is served and named."""
    corpus = SpectraCorpus.load(path)
    if corpus is not None and corpus.is_outdated:
        logger.warning("the SPECTRA corpus %s was made by an earlier recipe of `specserve calibrate corpus` (%d; "
                       "today's is %d): it is served as it is; calibrating again makes today's", path, corpus.recipe,
                       CORPUS_RECIPE)
    return corpus


def model_cache_dir(config: ModelConfig) -> Path:
    """Where model-derived tables and calibration artifacts live: --cache-dir, else $XDG_CACHE_HOME/specserve."""
    return Path(config.cache_dir) if config.cache_dir else default_cache_dir()


class SingleTokenForward:
    """[B] tokens -> [B, vocab] logits of the target at each token, seen right after the model's BOS token only.

    The learning-free n-gram paper's code runs the bare token at position 0. We put the BOS token first (when the
    model has one): a small model's first position is an attention sink whose predictions ignore the token (SmolLM2-135M
    predicts "-" "," "_" after every bare token), and in serving the model never runs without it.

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
            with CAPTURE_LOCK if self.runner.device.type == "cuda" else nullcontext():
                logits += self.runner.execute(
                    ForwardBatch([self._item(token, slot) for slot, token in enumerate(chunk, 1)])
                ).logits
        return torch.cat(logits)

    def _item(self, token: int, slot: int) -> ForwardItem:
        if self.bos_token_id is None:
            return ForwardItem([token], [0], [slot], [slot], 0, logit_rows=[0])
        return ForwardItem([token], [1], [slot], [0, slot], 1, logit_rows=[0])  # KV index 0 is the shared BOS
