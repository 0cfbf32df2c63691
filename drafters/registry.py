"""Builds the configured drafter by name from its sub-config and a context; `none` is plain decoding."""
from __future__ import annotations

import logging
from typing import Callable

from drafters.base import Drafter, DrafterContext
from drafters.bigram import BackgroundTable, LogProgress, build_bigram_table, table_path
from drafters.config import SpecConfig
from drafters.copyspec import CopySpecDrafter
from drafters.head_draft import HeadDrafter
from drafters.model_draft import CopyThenDraft, ModelDrafter
from drafters.ngram import NgramDrafter
from drafters.none import NoDrafter
from drafters.pld import PromptLookupDrafter
from drafters.pld_plus import PldPlusDrafter
from drafters.retrieval import BYTES_PER_TOKEN, SuffixIndex
from drafters.spectra import SpectraDrafter


def _copyspec(config: SpecConfig, context: DrafterContext) -> Drafter:
    return CopySpecDrafter(config.copy_gamma, config.copy_max_tokens)


def _draft(config: SpecConfig, context: DrafterContext) -> Drafter:
    draft, companion = context.draft_forward, context.companion_forward
    if draft is None:
        raise ValueError(f"--drafter {config.drafter} needs a draft model: "
                         "pass --draft-model (early-exit:N, a model or an EAGLE-3 head)")
    if companion is not None and companion.is_head != draft.is_head:
        raise ValueError("a companion scores a draft of its own kind: an EAGLE-3 head's companion is a head reading "
                         "the same target layers (`specserve train-draft --companion`), a model's is a model")
    if companion is not None and not context.sv_tables:
        logger.warning("no companion table for this draft and companion yet (`specserve calibrate sv`): the planner "
                       "weighs drafted tokens by %s", "the companion's own A" if draft.is_head else "statistics only")
    if draft.is_head:
        if companion is not None and companion.target_layers != draft.target_layers:
            raise ValueError(f"the companion head reads target layers {companion.target_layers}, the draft head "
                             f"{draft.target_layers}: the target's forward keeps one set of states")
        return HeadDrafter(draft, config.num_draft_tokens, companion, context.sv_tables)
    return ModelDrafter(draft, config.num_draft_tokens, companion, context.sv_tables)


def _copyspec_then_draft(config: SpecConfig, context: DrafterContext) -> Drafter:
    return CopyThenDraft(_copyspec(config, context), _draft(config, context))


def _pld(config: SpecConfig, context: DrafterContext) -> Drafter:
    return PromptLookupDrafter(config.pld_num_tokens)


def _pld_plus(config: SpecConfig, context: DrafterContext) -> Drafter:
    """PLD+ with the served model's calibration (`specserve calibrate pld-plus`); without one, the hidden-state
    variant at the paper's relative depth (layer 9 of 32)."""
    calibration = context.pld_plus_calibration
    if calibration is None:
        logger.info("no PLD+ calibration for this model yet (`specserve calibrate pld-plus`): "
                    "hidden states of layer %d", default_pld_plus_layer(context.num_layers))
    ranking = (config.pld_plus_ranking if config.pld_plus_ranking != "auto"
               else getattr(calibration, "ranking", "hidden"))
    if ranking == "attention" and calibration is None:
        raise ValueError("--pld-plus-ranking attention needs the calibrated heads: "
                         "run `specserve calibrate pld-plus` first")
    layer = config.pld_plus_layer or getattr(calibration, "layer", None) or default_pld_plus_layer(context.num_layers)
    return PldPlusDrafter(ranking, config.pld_plus_max_tokens, layer, _pld_plus_heads(config, calibration))


def _pld_plus_heads(config: SpecConfig, calibration) -> tuple[tuple[int, int], ...]:
    """The calibrated heads: as many as the calibration chose, or the best --pld-plus-num-heads of them."""
    if calibration is None:
        return ()
    count = config.pld_plus_num_heads or len(calibration.heads)
    return tuple((layer, head) for layer, head in calibration.ranked_heads[:count])


def default_pld_plus_layer(num_layers: int) -> int:
    return max(1, round(num_layers * 9 / 32))


def _ngram(config: SpecConfig, context: DrafterContext) -> Drafter:
    return NgramDrafter(config.ngram_k, config.ngram_w, model_bigram(context))


def model_bigram(context: DrafterContext) -> BackgroundTable:
    """The served model's bigram table: from the cache, or built in the background (and cached) on first use."""
    return BackgroundTable(
        table_path(context.cache_dir, context.model_fingerprint),
        lambda: build_bigram_table(context.next_token_logits, context.vocab_size, LogProgress("model bigram table")),
    )


def _spectra(config: SpecConfig, context: DrafterContext) -> Drafter:
    """SPECTRA with its traffic index (unless --spectra-index-mib 0), and the corpus and model n-grams `specserve
    calibrate corpus` made for the served model, if any."""
    traffic = SuffixIndex(config.spectra_index_mib * 2**20) if config.spectra_index_mib else None
    corpus = None
    if context.spectra_corpus:
        corpus = SuffixIndex(sum(BYTES_PER_TOKEN * len(document) for document in context.spectra_corpus))
        for document in context.spectra_corpus:
            corpus.add(document)
    elif config.drafter == "spectra":
        logger.info("no SPECTRA corpus for this model yet (`specserve calibrate corpus`): retrieval from the "
                    "server's own responses only")
    return SpectraDrafter(config.spectra_n, config.spectra_guesses, config.spectra_pool, config.spectra_tau,
                          traffic=traffic, corpus=corpus, model_ngrams=context.model_ngrams,
                          **_spectra_bigram(config, context))


def _spectra_core(config: SpecConfig, context: DrafterContext) -> Drafter:
    return SpectraDrafter(config.spectra_n, config.spectra_guesses, config.spectra_pool, config.spectra_tau,
                          **_spectra_bigram(config, context))


def _spectra_bigram(config: SpecConfig, context: DrafterContext) -> dict:
    """SPECTRA's model-bigram rows, the table built only when it has any."""
    rows = config.spectra_bigram_rows
    return {"bigram": model_bigram(context) if rows else None, "bigram_guesses": rows}


logger = logging.getLogger("specserve.drafters")

_BUILDERS: dict[str, Callable[[SpecConfig, DrafterContext], Drafter]] = {
    "none": lambda config, context: NoDrafter(),
    "copyspec": _copyspec,
    "copyspec+draft": _copyspec_then_draft,
    "draft": _draft,
    "ngram": _ngram,
    "pld": _pld,
    "pld-plus": _pld_plus,
    "spectra": _spectra,
    "spectra-core": _spectra_core,
}

DRAFTER_NAMES = tuple(_BUILDERS)


def build_drafter(config: SpecConfig, context: DrafterContext) -> Drafter:
    try:
        builder = _BUILDERS[config.drafter]
    except KeyError:
        raise ValueError(f"unknown drafter {config.drafter!r}; choose one of {DRAFTER_NAMES}") from None
    return builder(config, context)
