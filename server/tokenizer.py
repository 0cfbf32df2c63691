"""Loads the tokenizer that belongs to the served model."""
from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import ModelConfig
from engine.model_source import resolve_model_source


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    source = resolve_model_source(config.model)
    return AutoTokenizer.from_pretrained(
        source.path, trust_remote_code=config.trust_remote_code, **source.from_pretrained_kwargs()
    )
