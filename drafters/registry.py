"""Builds the configured drafter by name from its sub-config and a context; `none` means plain decoding."""
from __future__ import annotations

from typing import Callable

from drafters.base import Drafter, DrafterContext
from drafters.bigram import BackgroundTable, LogProgress, build_bigram_table, table_path
from drafters.config import SpecConfig
from drafters.copyspec import CopySpecDrafter
from drafters.ngram import NgramDrafter


def _copyspec(config: SpecConfig, context: DrafterContext) -> Drafter:
    return CopySpecDrafter(config.copy_gamma, config.copy_max_tokens)


def _ngram(config: SpecConfig, context: DrafterContext) -> Drafter:
    return NgramDrafter(config.ngram_k, config.ngram_w, model_bigram(context))


def model_bigram(context: DrafterContext) -> BackgroundTable:
    """The served model's bigram table: from the cache, or built in the background (and cached) on first use."""
    return BackgroundTable(
        table_path(context.cache_dir, context.model_fingerprint),
        lambda: build_bigram_table(context.next_token_logits, context.vocab_size, LogProgress("model bigram table")),
    )


_BUILDERS: dict[str, Callable[[SpecConfig, DrafterContext], Drafter]] = {
    "copyspec": _copyspec,
    "ngram": _ngram,
}

DRAFTER_NAMES = ("none", *_BUILDERS)


def build_drafter(config: SpecConfig, context: DrafterContext) -> Drafter | None:
    if config.drafter == "none":
        return None
    try:
        builder = _BUILDERS[config.drafter]
    except KeyError:
        raise ValueError(f"unknown drafter {config.drafter!r}; choose one of {DRAFTER_NAMES}") from None
    return builder(config, context)
