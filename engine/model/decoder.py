"""A lean packed forward for the decoders specserve knows: the model's own modules and weights, none of transformers'
call machinery around them.

transformers' forward builds masks, output records, keyword plumbing and a module call per norm, projection and MLP
on every layer; at batch 1 on the CPU that Python cost rivals the quantised matmuls themselves
(bench/results/step-profile). This forward walks the same layers with plain tensor calls and the same arithmetic, and
attends through the paged attention directly. Two layer forms (`supports` says which models have one; others keep
transformers' forward, engine/model/packed_runner.py chooses):
- Llama (Llama, Qwen2, Mistral): pre-norm RMSNorm, rotary, grouped-query attention, SiLU-gated MLP.
- Gemma 3: the same with RMSNorms that scale by 1 + weight, query and key norms per head, a norm after attention and
  after the MLP as well as before each, embeddings scaled by sqrt(hidden), a GELU-tanh gated MLP, and per layer type
  ("sliding_attention", "full_attention") its own rotary base and attention window.
Every layer attends through its own sliding window where it has one (`sliding_window`), and the output logits are
soft-capped where the config says so.

Each layer's query, key and value projections run as one Linear whose output channels are the three concatenated,
and its gate and up projections likewise (engine/model/weights.py `fuse_linears`): a Linear computes each output
channel from its own weights, so the fused layers give the same numbers in fewer, larger kernel calls.

On the CPU with float32 activations the operators between the matmuls are fused too (engine/model/csrc/fused_ops.cpp):
per layer one call for the rotary embedding of queries and keys (Gemma's query and key norms before it) that also
writes the keys and values into the pool, one for the residual add and the next norm, one for the gated activation,
where torch takes some thirty small operators, each costing more in dispatch than in arithmetic at batch 1. Each
computes every row alone (batch invariance holds); the norms and activations round differently from torch's in the
last bits (tests/engine/model/test_decoder.py bounds it), the rotary embedding and the residual add do not. Where the
projections are GGUF blocks and every row is attended in place (decoding, verifying), the whole layer is one C++ call
(engine/model/csrc/decoder_layer.cpp), the same kernels in the same order without Python between them. On a GPU the
same four fused calls are Triton kernels (engine/model/triton_ops.py), in the model's dtype. Elsewhere (bfloat16 on
the CPU, no C++ compiler, SPECSERVE_CPU_ISA=none, no Triton) the layers run as torch operators.
On the CPU the Linear weights every forward streams are kept in transparent huge pages (engine/model/huge_pages.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from engine.model.block_linear import BlockLinear
from engine.model.cpu_kernels import fused_ops_available
from engine.model.huge_pages import move_to_huge_pages
from engine.model.paged_attention import PackedBatch, attend, in_place_spans, paged_attention, triton_available
from engine.model.weights import ConcatenatedLinear, fuse_linears

LLAMA_FORM = {"llama", "qwen2", "mistral"}  # model_type of configs whose decoder layer is exactly the Llama form
GEMMA_FORM = {"gemma3_text"}
GATED_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


def supports(model: torch.nn.Module) -> bool:
    config = model.config
    activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    return config.model_type in LLAMA_FORM | GEMMA_FORM and activation in GATED_ACTIVATIONS


@dataclass
class Norm:
    """An RMSNorm: F.rms_norm by WEIGHT (Gemma's 1 + weight, precomputed), computed in float32."""

    weight: torch.Tensor
    eps: float
    gemma: bool = False  # Gemma scales in float32 before the cast back; Llama casts, then scales in the model's dtype

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.weight, self.eps, self.gemma)


@dataclass
class LayerWeights:
    index: int  # the layer's KV layer in the pool
    input_norm: Norm
    qkv: torch.nn.Module  # [hidden] -> [q | k | v]
    output: torch.nn.Module
    mlp_norm: Norm  # before the MLP
    gate_up: torch.nn.Module  # [hidden] -> [gate | up]
    down: torch.nn.Module
    rotary_type: str | None = None  # the rotary embedding's layer type (Gemma 3); None: the model's one rotary
    sliding_window: int | None = None  # keys within this many positions of the query, or all
    query_norm: Norm | None = None  # per head, before rotary (Gemma 3)
    key_norm: Norm | None = None
    attention_out_norm: Norm | None = None  # on the attention's output, before the residual add (Gemma 3)
    mlp_out_norm: Norm | None = None  # on the MLP's output, before the residual add (Gemma 3)
    whole_layer_args: tuple | None = None  # the layer's own arguments of decoder_layer, where its kernel runs it


class LeanDecoder:
    """Runs a packed forward over MODEL's layers: embeddings, decoder layers, final norm and LM head."""

    def __init__(self, model: torch.nn.Module) -> None:
        config, inner = model.config, model.model
        gemma = config.model_type in GEMMA_FORM
        self.embed = inner.embed_tokens  # Gemma's scales by sqrt(hidden) itself
        self.rotary = inner.rotary_emb
        self.final_norm = _norm(inner.norm, gemma)
        self.lm_head = model.lm_head
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.activation = getattr(config, "hidden_act", None) or config.hidden_activation
        self.act = GATED_ACTIVATIONS[self.activation]
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        scalar = getattr(config, "query_pre_attn_scalar", None) if gemma else None
        self.scaling = (scalar or self.head_dim) ** -0.5
        self.layers = [_layer_weights(config, layer, gemma) for layer in inner.layers]
        self.next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]  # after each layer
        if inner.embed_tokens.weight.device.type == "cpu":
            move_to_huge_pages([*(part for x in self.layers for part in (x.qkv, x.output, x.gate_up, x.down)),
                                self.lm_head])
        self.ops = _fused_ops(inner.embed_tokens.weight.device) if all(_fusable(x) for x in self.layers) else None
        self.fuses = self.ops is not None
        if self.ops is not None and self.ops is torch.ops.specserve:
            for layer, next_norm in zip(self.layers, self.next_norms):
                layer.whole_layer_args = whole_layer_args(layer, next_norm, self.num_heads, self.num_kv_heads,
                                                          self.scaling, self.activation)

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor, packed: PackedBatch
    ) -> torch.Tensor:
        """input_ids, position_ids [total]; rows [n] packed rows whose logits return -> [n, vocab]."""
        hidden = self.embed(input_ids)  # [total, hidden]
        rotations = {kind: self._rotation(hidden, position_ids, kind) for kind in {x.rotary_type for x in self.layers}}
        if self.fuses and (hidden.device.type != "cpu" or hidden.dtype == packed.pool.keys.dtype == torch.float32):
            logits = self.lm_head(self._fused_layers(hidden, rotations, packed)[rows])
            return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap
        for layer in self.layers:
            hidden = self._layer(layer, hidden, *rotations[layer.rotary_type], packed)
            packed.keep_hidden(layer.index + 1, hidden)
        logits = self.lm_head(self.final_norm(hidden[rows]))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _rotation(self, hidden: torch.Tensor, position_ids: torch.Tensor, kind: str | None) -> tuple:
        """cos, sin [total, 1, head_dim] of the rotary embedding of layer type KIND."""
        args = (hidden, position_ids[None]) if kind is None else (hidden, position_ids[None], kind)
        return tuple(t[0, :, None, :] for t in self.rotary(*args))

    def _fused_layers(self, hidden: torch.Tensor, rotations: dict, packed: PackedBatch) -> torch.Tensor:
        """The layers with the fused operators: HIDDEN [total, hidden] updated in place, layer by layer, to the last
        layer's output -> that output final-normed. Each layer returns its output normed by the next layer's input
        norm (the final norm after the last), the residual add and the norm one call."""
        first = self.layers[0].input_norm
        normed = self.ops.rms_norm(hidden, first.weight, first.eps)
        pool = packed.pool
        for layer, next_norm in zip(self.layers, self.next_norms):
            spans = in_place_spans(packed, layer.sliding_window, hidden.shape[0]) if layer.whole_layer_args else None
            if spans is None:
                normed = self._fused_layer(layer, hidden, normed, next_norm, *rotations[layer.rotary_type], packed)
            else:
                normed = torch.ops.specserve.decoder_layer(  # the CPU's whole-layer kernel
                    hidden, normed, *rotations[layer.rotary_type], packed.write_slots, *spans,
                    pool.layer_keys[layer.index], pool.layer_values[layer.index], *layer.whole_layer_args)
            packed.keep_hidden(layer.index + 1, hidden)
        return normed

    def _fused_layer(
        self, layer: LayerWeights, hidden: torch.Tensor, normed: torch.Tensor, next_norm: Norm, cos: torch.Tensor,
        sin: torch.Tensor, packed: PackedBatch,
    ) -> torch.Tensor:
        """One layer as `_layer` computes it, on NORMED (its input norm of HIDDEN); HIDDEN becomes its output, in
        place -> that output normed by NEXT_NORM."""
        ops, pool, query_norm, key_norm = self.ops, packed.pool, layer.query_norm, layer.key_norm
        query = ops.rope_write(
            layer.qkv(normed), cos, sin, self.num_heads, self.num_kv_heads, _weight(query_norm), _weight(key_norm),
            _eps(query_norm), pool.layer_keys[layer.index], pool.layer_values[layer.index], packed.write_slots,
        )
        attended = attend(layer.index, query, self.scaling, packed, layer.sliding_window)
        attended = layer.output(attended.view(hidden.shape[0], -1))
        out_norm, mlp_norm = layer.attention_out_norm, layer.mlp_norm
        normed = ops.add_rms_norm(hidden, attended, mlp_norm.weight, mlp_norm.eps, _weight(out_norm), _eps(out_norm))
        mlp = layer.down(ops.gated_activation(layer.gate_up(normed), self.activation))
        out_norm = layer.mlp_out_norm
        return ops.add_rms_norm(hidden, mlp, next_norm.weight, next_norm.eps, _weight(out_norm), _eps(out_norm))

    def _layer(
        self, layer: LayerWeights, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: PackedBatch
    ) -> torch.Tensor:
        total = hidden.shape[0]
        qkv = layer.qkv(layer.input_norm(hidden)).view(total, -1, self.head_dim)
        query, key, value = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if layer.query_norm is not None:
            query, key = layer.query_norm(query), layer.key_norm(key)
            rotated = torch.cat((query, key), dim=1)
        else:
            rotated = qkv[:, :self.num_heads + self.num_kv_heads]
        query, key = rotate(rotated, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)  # both at once
        attended = paged_attention(layer.index, query, key, value, self.scaling, packed, layer.sliding_window)
        attended = layer.output(attended.view(total, -1))
        hidden = hidden + (attended if layer.attention_out_norm is None else layer.attention_out_norm(attended))
        gate, up = layer.gate_up(layer.mlp_norm(hidden)).chunk(2, dim=-1)
        mlp = layer.down(self.act(gate) * up)
        return hidden + (mlp if layer.mlp_out_norm is None else layer.mlp_out_norm(mlp))


def whole_layer_args(
    layer: LayerWeights, next_norm: Norm, num_heads: int, num_kv_heads: int, scaling: float, activation: str,
) -> tuple | None:
    """decoder_layer's arguments that are LAYER's own (engine/model/csrc/decoder_layer.cpp: `_fused_layer` in one C++
    call), or None unless its four Linears are GGUF blocks of one instruction set."""
    linears = [_block_parts(linear) for linear in (layer.qkv, layer.output, layer.gate_up, layer.down)]
    if any(parts is None for parts in linears) or len({part.isa for parts in linears for part in parts}) != 1:
        return None
    parts = [part for parts in linears for part in parts]
    empty = torch.empty(0)
    weights = [t for p in parts for t in (p.codes, p.scales, empty if p.mins is None else p.mins)]
    forms = [n for p in parts for n in (p.bits, p.sub, p.out_features)]
    query_norm, out_norm, mlp_out_norm = layer.query_norm, layer.attention_out_norm, layer.mlp_out_norm
    return (weights, forms, [len(p) for p in linears], parts[0].isa, num_heads, num_kv_heads, scaling,
            _weight(query_norm), _weight(layer.key_norm), _eps(query_norm), layer.mlp_norm.weight, layer.mlp_norm.eps,
            _weight(out_norm), _eps(out_norm), _weight(mlp_out_norm), _eps(mlp_out_norm), next_norm.weight,
            next_norm.eps, activation)


def _layer_weights(config, layer: torch.nn.Module, gemma: bool) -> LayerWeights:
    attention, mlp = layer.self_attn, layer.mlp
    weights = LayerWeights(
        index=attention.layer_idx,
        input_norm=_norm(layer.input_layernorm, gemma),
        qkv=fuse_linears(attention, ("q_proj", "k_proj", "v_proj")),
        output=attention.o_proj,
        mlp_norm=_norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm, gemma),
        gate_up=fuse_linears(mlp, ("gate_proj", "up_proj")),
        down=mlp.down_proj,
        sliding_window=layer_sliding_window(config, attention),
    )
    if gemma:
        weights.rotary_type = config.layer_types[attention.layer_idx]
        weights.query_norm, weights.key_norm = _norm(attention.q_norm, gemma), _norm(attention.k_norm, gemma)
        weights.attention_out_norm = _norm(layer.post_attention_layernorm, gemma)
        weights.mlp_out_norm = _norm(layer.post_feedforward_layernorm, gemma)
    return weights


def _block_parts(linear: torch.nn.Module) -> list[BlockLinear] | None:
    """LINEAR's GGUF-block parts, whose outputs side by side are its output; None if it is another kind."""
    parts = list(linear.parts) if isinstance(linear, ConcatenatedLinear) else [linear]
    return parts if all(isinstance(part, BlockLinear) for part in parts) else None


def _fused_ops(device: torch.device):
    """The fused operators on DEVICE: the CPU's C++ ones (built on first use) or a GPU's Triton ones
    (engine/model/triton_ops.py); None where neither runs (no compiler, SPECSERVE_CPU_ISA=none, no Triton)."""
    if device.type == "cpu":
        return torch.ops.specserve if fused_ops_available() else None
    if not triton_available(device):
        return None
    from engine.model import triton_ops  # GPU only: imports Triton

    return triton_ops


def _fusable(layer: LayerWeights) -> bool:
    """Whether the fused rotary can norm LAYER's queries and keys (one eps for both; Gemma 3 gives both its own)."""
    return layer.query_norm is None or layer.query_norm.eps == layer.key_norm.eps


def _weight(norm: Norm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _eps(norm: Norm | None) -> float:
    return 0.0 if norm is None else norm.eps


def layer_sliding_window(config, attention: torch.nn.Module) -> int | None:
    """The attention window of a layer as transformers applies it: the module's own (Gemma, Qwen2: per layer type),
    else the config's (Mistral, Phi-3: every layer)."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return getattr(config, "sliding_window", None)


def _norm(module: torch.nn.Module, gemma: bool) -> Norm:
    eps = getattr(module, "variance_epsilon", None) or module.eps
    weight = (1.0 + module.weight.float()) if gemma else module.weight
    return Norm(weight, eps, gemma)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """transformers' RMSNorms by torch's own rms_norm, which gives the same numbers on float32
    (tests/engine/model/test_decoder.py) in fewer calls: Llama's normalises in float32 and scales in the model's
    dtype; Gemma's scales by 1 + weight in float32, then casts."""
    if hidden.dtype == torch.float32:
        return F.rms_norm(hidden, weight.shape, weight, eps)
    if gemma:
        return F.rms_norm(hidden.float(), weight.shape, weight, eps).to(hidden.dtype)
    return weight * F.rms_norm(hidden.float(), weight.shape, None, eps).to(hidden.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it: x cos + rotate_half(x) sin. x [total, heads, head_dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
