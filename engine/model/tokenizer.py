"""Loads the tokenizer that belongs to the served model."""
from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import ModelConfig
from engine.model.gguf_cache import loadable_source
from engine.model.model_source import resolve_model_source


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer; a GGUF model's from its dequantized cache (the same vocabulary, merges and chat
    template)."""
    checkpoint = loadable_source(resolve_model_source(config.model))
    return AutoTokenizer.from_pretrained(
        checkpoint.path, trust_remote_code=config.trust_remote_code, **checkpoint.from_pretrained_kwargs()
    )
