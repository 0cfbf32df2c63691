"""Shared fixtures: a tiny randomly initialised Llama-style model built from a config."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_VOCAB = 48


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits make outputs repeat, so copying has something to find
        model.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return str(path)
