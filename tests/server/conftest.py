"""Shared fixtures of the HTTP-layer unit tests: the embedded model's real tokenizer."""
from __future__ import annotations

import pytest

from engine.config import ModelConfig
from engine.model.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2-135M-Instruct's tokenizer from the embedded GGUF (byte-level BPE, ChatML)."""
    return load_tokenizer(ModelConfig(model=None))
