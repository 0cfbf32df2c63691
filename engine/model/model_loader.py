"""Loads the target model onto the configured device and dtype."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from engine.config import ModelConfig
from engine.model.gguf_cache import loadable_source
from engine.model.model_source import ModelSource, resolve_model_source
from engine.model.servable import check_servable, config_refusal, refusal
from engine.model.weights import apply_weights, resolve_weights

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class LoadedModel:
    model: torch.nn.Module
    source: ModelSource
    device: torch.device
    max_model_len: int
    eos_token_ids: list[int]
    weights: str = "float32"  # how its Linear layers keep their weights (engine/model/weights.py)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_model(config: ModelConfig) -> LoadedModel:
    source = resolve_model_source(config.model)
    device = resolve_device(config.device)
    checkpoint = loadable_source(source)  # a GGUF's dequantized copy; the served name stays SOURCE's
    model_config = AutoConfig.from_pretrained(checkpoint.path, trust_remote_code=config.trust_remote_code,
                                              **checkpoint.from_pretrained_kwargs())
    check_servable(config_refusal(model_config), source.name)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint.path,
        dtype=resolve_dtype(config.dtype, device),
        attn_implementation="sdpa",
        trust_remote_code=config.trust_remote_code,
        **checkpoint.from_pretrained_kwargs(),
    )
    model.to(device).eval()
    check_servable(refusal(model), source.name)
    gguf_path = source.gguf_path
    weights = resolve_weights(config.weights, device, gguf_path)
    apply_weights(model, weights, gguf_path)
    if device.type == "cpu" and weights == "float32":
        store_linear_weights_input_major(model)
    return LoadedModel(model, source, device, _max_model_len(model, config), _eos_token_ids(model), weights)


@torch.no_grad()
def store_linear_weights_input_major(model: torch.nn.Module) -> None:
    """Keep every Linear weight `[out, in]` as the transpose of a contiguous `[in, out]` tensor.

    The values and shapes are unchanged; only the memory layout differs. On the CPU, MKL
    multiplies a few rows by a weight stored this way faster than by the row-major weight,
    and decoding steps carry a few rows per request. A LM head tied to the input
    embeddings gets its own copy, so the embedding lookup keeps its row-major table.
    """
    head = model.get_output_embeddings()
    if head is not None and head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.detach()
            module.weight = torch.nn.Parameter(weight.t().contiguous().t(), requires_grad=False)


def _max_model_len(model: torch.nn.Module, config: ModelConfig) -> int:
    own_limit = getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    if config.max_model_len is not None:
        if config.max_model_len > own_limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {own_limit}")
        return config.max_model_len
    return min(own_limit, DEFAULT_MAX_MODEL_LEN)


def _eos_token_ids(model: torch.nn.Module) -> list[int]:
    generation_config = getattr(model, "generation_config", None) or GenerationConfig()
    eos = generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
