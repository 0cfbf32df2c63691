"""Shared fixtures: tiny randomly initialised Llama-style and Gemma-3-shaped models built from configs; the tests' own
data sets;
and a guard that fails any test reaching for the benchmark data beside the checkout, which a user's clone lacks."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels (engine/model/triton_attention.py) run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

TINY_VOCAB = 48
GEMMA_WINDOW = 512  # Gemma 3 270M's sliding window
REPO = Path(__file__).resolve().parent.parent
TEST_DATA_DIR = REPO / "tests" / "data"  # conversations and prompts written for the tests, in the real sets' formats
# where the benchmark data lives on the project's machines
OUTSIDE_DATA = (str(REPO.parent / "shared"), str(REPO / "shared"))


def _refuse_outside_data(event: str, args: tuple) -> None:
    """An audit hook: opening or listing anything under shared/ fails the test that does it."""
    if (
        event not in ("open", "os.listdir", "os.scandir")
        or not args
        or not isinstance(args[0], (str, bytes, os.PathLike))
    ):
        return
    path = os.path.abspath(os.fsdecode(args[0]))
    if any(path == root or path.startswith(root + os.sep) for root in OUTSIDE_DATA):
        raise PermissionError(f"tests must not read {path}: a fresh clone has nothing beside it; use tests/data")


sys.addaudithook(_refuse_outside_data)


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


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory) -> str:
    """Gemma 3's shape at small widths: its 512-token sliding window on five of every six layers, each layer type
    with its own rotary base, query and key norms, four norms per layer, scaled embeddings, GELU-tanh MLP."""
    torch.manual_seed(7)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=GEMMA_WINDOW,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=4096,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.2,
    )
    path = tmp_path_factory.mktemp("tiny-gemma")
    Gemma3ForCausalLM(config).save_pretrained(path)
    return str(path)


def _save_tiny_llama(path, seed: int, vocab_size: int, num_layers: int) -> str:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_draft_model_dir(tmp_path_factory) -> str:
    """A separate, randomly initialised one-layer draft model with the tiny model's vocabulary."""
    return _save_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), seed=99, vocab_size=TINY_VOCAB, num_layers=1)


@pytest.fixture(scope="session")
def tiny_other_vocab_dir(tmp_path_factory) -> str:
    """A tiny model whose vocabulary is not the tiny model's."""
    return _save_tiny_llama(
        tmp_path_factory.mktemp("tiny-other-vocab"), seed=7, vocab_size=TINY_VOCAB + 16, num_layers=1
    )


@pytest.fixture(scope="session")
def tiny_head_dir(tmp_path_factory) -> str:
    """A random EAGLE-3 head for the tiny model, written by hand in the public layout (SpecForge's names, vLLM's
    config keys): its draft vocabulary is every other token id, so half the target's tokens are never drafted."""
    return _write_tiny_head(tmp_path_factory.mktemp("tiny-eagle3-head"), 4321, torch.arange(0, TINY_VOCAB, 2))


@pytest.fixture(scope="session")
def tiny_companion_head_dir(tmp_path_factory) -> str:
    """Another random head, for SV's companion: other weights and another draft vocabulary (every third id)."""
    return _write_tiny_head(tmp_path_factory.mktemp("tiny-eagle3-companion"), 8765, torch.arange(0, TINY_VOCAB, 3))


def _write_tiny_head(path, seed: int, draft_ids: torch.Tensor) -> str:
    import json

    from safetensors.torch import save_file

    torch.manual_seed(seed)
    hidden, inner, heads, kv_heads, head_dim = 32, 64, 4, 2, 8
    tensors = {
        "fc.weight": torch.randn(hidden, 3 * hidden) * 0.2,
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": torch.randn(heads * head_dim, 2 * hidden) * 0.2,
        "midlayer.self_attn.k_proj.weight": torch.randn(kv_heads * head_dim, 2 * hidden) * 0.2,
        "midlayer.self_attn.v_proj.weight": torch.randn(kv_heads * head_dim, 2 * hidden) * 0.2,
        "midlayer.self_attn.o_proj.weight": torch.randn(hidden, heads * head_dim) * 0.2,
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.mlp.gate_proj.weight": torch.randn(inner, hidden) * 0.2,
        "midlayer.mlp.up_proj.weight": torch.randn(inner, hidden) * 0.2,
        "midlayer.mlp.down_proj.weight": torch.randn(hidden, inner) * 0.2,
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": torch.randn(len(draft_ids), hidden),
        "d2t": draft_ids - torch.arange(len(draft_ids)),
        "t2d": torch.zeros(TINY_VOCAB, dtype=torch.bool).index_fill(0, draft_ids, True),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inner, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-6, "hidden_act": "silu", "vocab_size": TINY_VOCAB,
        "draft_vocab_size": len(draft_ids), "max_position_embeddings": 1024, "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]},  # the tiny target has two layers
    }
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
