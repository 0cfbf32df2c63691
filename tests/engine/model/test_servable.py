"""A model the engine cannot serve correctly is refused at start-up with the reason; the ones it serves pass."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from engine.config import ModelConfig
from engine.model.model_loader import load_model
from engine.model.servable import refusal

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)


def test_the_models_it_serves_pass(tiny_model_dir):
    assert refusal(AutoModelForCausalLM.from_pretrained(tiny_model_dir)) is None
    assert refusal(Gemma3ForCausalLM(Gemma3TextConfig(**TINY, sliding_window=8))) is None


def test_soft_capped_attention_is_refused_at_start_up(tmp_path):
    """Gemma 2 soft-caps its attention scores, which the paged attention does not: loading it fails, naming why."""
    torch.manual_seed(0)
    Gemma2ForCausalLM(Gemma2Config(**TINY, sliding_window=8, attn_logit_softcapping=50.0)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cannot serve .* correctly: it soft-caps its attention scores"):
        load_model(ModelConfig(model=str(tmp_path), device="cpu"))


def test_bidirectional_attention_is_refused():
    model = Gemma3ForCausalLM(Gemma3TextConfig(**TINY, sliding_window=8, use_bidirectional_attention=True))
    assert "bidirectionally" in refusal(model)
