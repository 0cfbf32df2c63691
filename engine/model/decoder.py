"""A lean packed forward for Llama-family decoders: the model's own modules and weights, none of transformers' call
machinery around them.

transformers' forward builds masks, output records, keyword plumbing and a module call per norm, projection and MLP
on every layer; at batch 1 on the CPU that Python cost rivals the 4-bit matmuls themselves (bench/results/step-profile).
This forward walks the same layers with plain tensor calls and the same arithmetic, and attends through the paged
attention directly. Layers of the Llama form only (pre-norm RMSNorm, rotary, grouped-query attention, gated MLP):
`supports` says which; others keep transformers' forward (engine/model/packed_runner.py chooses).

Each layer's query, key and value projections run as one Linear whose output channels are the three concatenated,
and its gate and up projections likewise (engine/model/weights.py `fuse_linears`): a Linear computes each output
channel from its own weights, so the fused layers give the same numbers in fewer, larger kernel calls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.paged_attention import PackedBatch, paged_attention
from engine.model.weights import fuse_linears

# model_type of transformers configs whose decoder layer is exactly the Llama form (Qwen2's projections carry a bias,
# which the fused Linear keeps). Neither this forward nor transformers' through the paged attention applies a sliding
# window (Mistral's, beyond 4,096 positions).
LLAMA_FORM = {"llama", "qwen2", "mistral"}
GATED_ACTIVATIONS = {"silu": F.silu}


def supports(model: torch.nn.Module) -> bool:
    return model.config.model_type in LLAMA_FORM and getattr(model.config, "hidden_act", None) in GATED_ACTIVATIONS


@dataclass
class LayerWeights:
    index: int  # the layer's KV layer in the pool
    input_norm: torch.Tensor
    qkv: torch.nn.Module  # [hidden] -> [q | k | v]
    output: torch.nn.Module
    post_norm: torch.Tensor
    gate_up: torch.nn.Module  # [hidden] -> [gate | up]
    down: torch.nn.Module


class LeanDecoder:
    """Runs a packed forward over MODEL's layers: embeddings, decoder layers, final norm and LM head."""

    def __init__(self, model: torch.nn.Module) -> None:
        config, inner = model.config, model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm, self.eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = model.lm_head
        self.act = GATED_ACTIVATIONS[config.hidden_act]
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.layers = [_layer_weights(layer) for layer in inner.layers]

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor, packed: PackedBatch
    ) -> torch.Tensor:
        """input_ids, position_ids [total]; rows [n] packed rows whose logits return -> [n, vocab]."""
        hidden = self.embed(input_ids)  # [total, hidden]
        cos, sin = (t[0, :, None, :] for t in self.rotary(hidden, position_ids[None]))  # [total, 1, head_dim]
        for layer in self.layers:
            hidden = self._layer(layer, hidden, cos, sin, packed)
            if packed.hidden_index is not None and packed.hidden_layer == layer.index + 1:
                packed.captured_hidden = hidden[packed.hidden_index].float().cpu()
        return self.lm_head(rms_norm(hidden[rows], self.final_norm, self.eps))

    def _layer(
        self, layer: LayerWeights, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: PackedBatch
    ) -> torch.Tensor:
        total = hidden.shape[0]
        qkv = layer.qkv(rms_norm(hidden, layer.input_norm, self.eps)).view(total, -1, self.head_dim)
        rotated = rotate(qkv[:, :self.num_heads + self.num_kv_heads], cos, sin)  # queries and keys at once
        query, key = rotated.split([self.num_heads, self.num_kv_heads], dim=1)
        value = qkv[:, self.num_heads + self.num_kv_heads:]
        attended = paged_attention(layer.index, query, key, value, self.scaling, packed)  # [total, heads, head_dim]
        hidden = hidden + layer.output(attended.view(total, -1))
        gate, up = layer.gate_up(rms_norm(hidden, layer.post_norm, self.eps)).chunk(2, dim=-1)
        return hidden + layer.down(self.act(gate) * up)


def _layer_weights(layer: torch.nn.Module) -> LayerWeights:
    attention, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        index=attention.layer_idx,
        input_norm=layer.input_layernorm.weight,
        qkv=fuse_linears(attention, ("q_proj", "k_proj", "v_proj")),
        output=attention.o_proj,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=fuse_linears(mlp, ("gate_proj", "up_proj")),
        down=mlp.down_proj,
    )


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm (computed in float32, scaled in the model's dtype) by torch's own rms_norm, which
    gives the same numbers on float32 (tests/engine/test_decoder.py) in fewer calls."""
    if hidden.dtype == torch.float32:
        return F.rms_norm(hidden, weight.shape, weight, eps)
    return weight * F.rms_norm(hidden.float(), weight.shape, None, eps).to(hidden.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it: x cos + rotate_half(x) sin. x [total, heads, head_dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
