"""How the target's Linear layers keep and multiply their weights: `--weights auto|float32|bfloat16|int8|int4|gguf`.

- float32: the weights as loaded (a GGUF dequantized exactly to float32).
- bfloat16: weights rounded to bfloat16; each Linear multiplies in bfloat16 (oneDNN).
- int8: weight-only int8, one symmetric scale per output channel, activations in bfloat16 (`_weight_int8pack_mm`).
- int4: weight-only 4-bit in groups of 32 with a scale and a zero per group (`_weight_int4pack_mm_for_cpu`),
  activations in bfloat16. A GGUF's 4-bit blocks (Q4_0, Q4_1, Q4_K: w = d q + m) map onto it without requantising:
  scale d, zero m + 8d, the same codes. Not exact: the kernel takes scales, zeros and activations in bfloat16, so d
  and m lose 3 of their 10 mantissa bits. Other weights are quantised to 4 bits by each group's range (min to max).
  The output layer stays int8.
- gguf: every Linear, the output layer included, in its GGUF block type's own codes and scales (Q4_0, Q4_1, Q5_0,
  Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; engine/model/gguf_blocks.py), tensor by tensor, activations rounded to 8 bits per
  block of 32 and products summed in integers as llama.cpp does on the CPU (engine/model/block_linear.py: AVX512-VNNI
  or AVX2). Weights of other types, or of models that are not GGUF, are rounded to 4 bits by range; an output layer
  stored as floats to 8 bits per block.
The served model is the one these weights make: speculation is exact against plain decoding of the same mode
(tests/engine/model/test_weights.py), not against float32. Norms, attention and the residual stream stay in the
model's dtype.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import WEIGHT_MODES  # the choices live with the config, which imports no torch
from engine.model import block_linear
from engine.model.blocks import BlockWeights
from engine.model.gguf_blocks import BLOCK_TYPES, block_weights
from engine.model.gguf_file import gguf_tensors

logger = logging.getLogger("specserve.engine")
GROUP_SIZE = 32  # weights per int4 group: a GGUF Q4 block
INT4_CHANNEL_MULTIPLE = 16  # the int4 CPU kernel needs output channels in multiples of 16
INT4_PACK_BLOCK = 64  # it packs output channels in blocks of 64: whole blocks' packings concatenate (tested)
OUTPUT_ROWS_CHECKED = 1024  # rows of the output layer compared with the loaded weights (the vocabulary is large)
GGUF_LINEARS = {  # transformers' module name -> the GGUF tensor of layer i
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


class Bf16Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.to(torch.bfloat16).contiguous())  # [out, in]
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)


class Int8Linear(torch.nn.Module):
    """Symmetric int8 per output channel: w = scale[n] * q[n, k]."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("q", q.contiguous())  # [out, in] int8
        self.register_buffer("scales", scales.to(torch.bfloat16))  # [out]
        self.out_features = q.shape[0]

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Int8Linear:
        weight = weight.float()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12)
        return cls(torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()
        return (torch.ops.aten._weight_int8pack_mm(rows, self.q, self.scales).to(x.dtype)
                .reshape(*shape[:-1], self.out_features))


class Int4Linear(torch.nn.Module):
    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        """packed: the kernel's packing of [out, in] 4-bit codes; scales_and_zeros [in / 32, out, 2]."""
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous())
        self.out_features = packed.shape[0]

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> Int4Linear:
        """codes [out, in] int32 in 0..15."""
        return cls(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1), scales_and_zeros)

    @classmethod
    def from_blocks(cls, blocks: BlockWeights) -> Int4Linear:
        """4-bit unsigned blocks (w = scale q + min): the kernel adds its zero to scale * (q - 8)."""
        if blocks.signed or blocks.bits != 4:
            raise ValueError("int4 takes 4-bit unsigned blocks (BlockWeights.by_range rounds any weights to them)")
        zeros = blocks.mins + 8 * blocks.scales
        return cls.from_codes(blocks.codes.to(torch.int32), torch.stack([blocks.scales.T, zeros.T], dim=-1))

    def codes(self) -> torch.Tensor:
        """The 4-bit codes back, [out, in] int32, read by the kernel itself (its packing is blocked by output channel
        in a layout of its own): with scale 1 and zero 0 it multiplies the identity into q - 8, exact in bfloat16."""
        num_groups = self.scales_and_zeros.shape[0]
        unit = torch.zeros(num_groups, self.out_features, 2, dtype=torch.bfloat16)
        unit[..., 0] = 1
        identity = torch.eye(num_groups * GROUP_SIZE, dtype=torch.bfloat16)
        shifted = torch.ops.aten._weight_int4pack_mm_for_cpu(identity, self.packed, GROUP_SIZE, unit)  # [in, out]
        return (shifted.float().T + 8).round().to(torch.int32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)


def llama_row_order(num_rows: int, num_heads: int) -> np.ndarray:
    """The rows transformers reads a Llama-architecture GGUF's q/k weight in (the inverse of llama.cpp's rotary
    permutation)."""
    return np.arange(num_rows).reshape(num_heads, num_rows // num_heads // 2, 2).swapaxes(2, 1).reshape(-1)


def resolve_weights(mode: str, device: torch.device, gguf_path: str | None) -> str:
    """The mode `auto` stands for: gguf for a GGUF with quantised blocks on a CPU where the integer kernels run
    (AVX512-VNNI or AVX2, and a C++ compiler), else float32, with a log line saying why."""
    if mode == "gguf" and not block_linear.available():
        raise ValueError("--weights gguf needs a CPU with AVX2 or AVX512-VNNI and a C++ compiler to build its "
                         "kernels (see the log)")
    if mode != "auto":
        return mode
    if device.type != "cpu" or not (gguf_path and gguf_has_blocks(gguf_path)):
        return "float32"
    if not block_linear.available():
        logger.warning("serving the GGUF's weights as float32: the integer kernels need a CPU with AVX2 or "
                       "AVX512-VNNI and a C++ compiler to build them (see the lines above), or SPECSERVE_CPU_ISA "
                       "forbids them")
        return "float32"
    return "gguf"


def gguf_has_blocks(path: str) -> bool:
    """Whether any of the GGUF's tensors is in a block type the integer kernels multiply."""
    return any(t.tensor_type in BLOCK_TYPES for t in gguf_tensors(path).values())


@torch.no_grad()
def apply_weights(model: torch.nn.Module, mode: str, gguf_path: str | None = None) -> None:
    """Replace the model's Linear layers (and its output layer) by those of MODE; float32 leaves them as they are."""
    if mode == "float32":
        return
    if mode not in WEIGHT_MODES[1:]:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {mode!r}")
    tensors = gguf_tensors(gguf_path) if mode in ("int4", "gguf") and gguf_path else {}
    kinds: dict[str, int] = {}
    for i, layer in enumerate(model.model.layers):
        for name, gguf_name in GGUF_LINEARS.items():
            parent_name, child_name = name.split(".")
            parent = getattr(layer, parent_name)
            heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
            tensor = tensors.get(f"blk.{i}.{gguf_name}.weight")
            blocks = file_blocks(getattr(parent, child_name).weight, tensor, heads.get(child_name))
            replacement, kept = _replacement(mode, getattr(parent, child_name), blocks)
            setattr(parent, child_name, replacement)
            kind = tensor.tensor_type.name if kept else "rounded by range"
            kinds[kind] = kinds.get(kind, 0) + 1
    output = tensors.get("output.weight") or tensors.get("token_embd.weight")
    model.lm_head = _output_layer(mode, model.lm_head, output)
    if mode in ("int4", "gguf"):
        logger.info("%s weights: Linear layers by the type they are kept in: %s", mode, dict(sorted(kinds.items())))


def file_blocks(weight: torch.Tensor, tensor, num_heads: int | None, max_rows: int | None = None
                ) -> BlockWeights | None:
    """TENSOR's blocks laid out as the loaded WEIGHT (transformers undoes llama.cpp's rotary row permutation of a
    Llama-architecture GGUF's q/k rows; other architectures keep the file's order): the order whose dequantized
    blocks equal WEIGHT (its first MAX_ROWS rows), or None where the type has no kernel or neither order matches."""
    if tensor is None or tensor.tensor_type not in BLOCK_TYPES:
        return None
    orders = [None] + ([llama_row_order(weight.shape[0], num_heads)] if num_heads else [])
    for order in orders:
        blocks = block_weights(tensor, order)
        rows = slice(0, max_rows)
        if blocks.shape == tuple(weight.shape) and torch.equal(
            BlockWeights(blocks.codes[rows], blocks.scales[rows], None if blocks.signed else blocks.mins[rows],
                         blocks.bits, blocks.sub).dequantize(), weight[rows].float()
        ):
            return blocks
    logger.warning("%s: its %s blocks do not give the loaded weights; rounding them by range", tensor.name,
                   tensor.tensor_type.name)
    return None


def _output_layer(mode: str, lm_head: torch.nn.Module, gguf_tensor) -> torch.nn.Module:
    if mode == "bfloat16":
        return Bf16Linear(lm_head.weight)
    if mode != "gguf":
        return Int8Linear.from_weight(lm_head.weight)
    blocks = file_blocks(lm_head.weight, gguf_tensor, None, max_rows=OUTPUT_ROWS_CHECKED)
    return block_linear.BlockLinear.from_blocks(blocks or BlockWeights.int8_symmetric(lm_head.weight))


def _replacement(mode: str, linear: torch.nn.Linear, blocks: BlockWeights | None) -> tuple[torch.nn.Module, bool]:
    """The Linear of MODE for LINEAR, and whether it keeps the file's BLOCKS as they are."""
    if linear.bias is not None:
        raise ValueError(f"--weights {mode} supports Linear layers without bias only")
    if mode == "bfloat16":
        return Bf16Linear(linear.weight), False
    if mode == "int8":
        return Int8Linear.from_weight(linear.weight), False
    if linear.out_features % INT4_CHANNEL_MULTIPLE or linear.in_features % GROUP_SIZE:
        raise ValueError(f"--weights {mode} needs layers of multiples of {INT4_CHANNEL_MULTIPLE} x {GROUP_SIZE}")
    if mode == "int4" and blocks is not None and (blocks.signed or blocks.bits != 4):
        blocks = None  # int4 keeps only 4-bit blocks as they are
    kept = blocks is not None
    blocks = blocks or BlockWeights.by_range(linear.weight)
    if mode == "gguf":
        return block_linear.BlockLinear.from_blocks(blocks), kept
    return Int4Linear.from_blocks(blocks), kept


class ConcatenatedLinear(torch.nn.Module):
    """Linear layers that cannot share one kernel call (different block types), called one after another and their
    outputs concatenated: what fusing them gives when their weights do not concatenate."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class OutputSlice(torch.nn.Module):
    """What a fused Linear leaves in the place of one of its parts: that part's output channels of the fused output.
    The lean forward (engine/model/decoder.py) calls the fused Linear once; the model's own forward, which calibration
    and tools call, computes the fused output for each part and keeps its slice: right, and slower."""

    def __init__(self, fused: torch.nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.fused, self.start, self.end = fused, start, end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start:self.end]


@torch.no_grad()
def fuse_linears(parent: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Module:
    """One Linear whose output channels are those of PARENT's Linears NAMES, in order; each part is left as its
    OutputSlice. Idempotent: parts already fused together give their fused Linear back. A Linear computes each output
    channel from its own weights, so the fused one gives the parts' numbers (checked in
    tests/engine/test_decoder.py)."""
    parts = [getattr(parent, name) for name in names]
    if all(isinstance(part, OutputSlice) for part in parts) and len({id(part.fused) for part in parts}) == 1:
        return parts[0].fused
    fused, start = concatenate_linears(parts), 0
    for name, part in zip(names, parts):
        end = start + part.out_features
        setattr(parent, name, OutputSlice(fused, start, end))
        start = end
    return fused


def concatenate_linears(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """One Linear of PARTS' output channels side by side, the parts left as they are."""
    kind = type(parts[0])
    if any(type(part) is not kind for part in parts):
        raise ValueError(f"cannot fuse Linear layers of different kinds: {[type(p).__name__ for p in parts]}")
    if kind is Int4Linear:
        scales_and_zeros = torch.cat([p.scales_and_zeros for p in parts], dim=1)
        if all(p.out_features % INT4_PACK_BLOCK == 0 for p in parts):  # whole blocks: the packings concatenate
            return Int4Linear(torch.cat([p.packed for p in parts]), scales_and_zeros)
        return Int4Linear.from_codes(torch.cat([p.codes() for p in parts]), scales_and_zeros)
    if kind is block_linear.BlockLinear:
        try:
            return block_linear.concatenate(parts)
        except ValueError:  # different block types (a Q5_0 query beside a Q8_0 value may fuse; Q4_K beside Q6_K not)
            return ConcatenatedLinear(parts)
    if kind is Int8Linear:
        return Int8Linear(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]))
    if kind is Bf16Linear:
        return Bf16Linear(torch.cat([p.weight for p in parts]))
    if kind is torch.nn.Linear:
        return _float_linear(parts)
    raise ValueError(f"cannot fuse Linear layers of kind {kind.__name__}")


def _float_linear(parts: list[torch.nn.Linear]) -> torch.nn.Linear:
    """The parts' weights (and biases) concatenated, kept input-major when the parts were
    (engine/model/model_loader.py)."""
    weight = torch.cat([p.weight for p in parts])
    if parts[0].weight.stride(0) == 1:
        weight = weight.t().contiguous().t()
    bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = torch.nn.Parameter(bias, requires_grad=False)
    return fused



def apply_head_weights(module: torch.nn.Module, mode: str) -> None:
    """Every Linear under MODULE (a draft head, whose weights come as floats) in the form MODE gives the target's:
    8-bit blocks for gguf (the block kernels), int8 for int8 and int4 (a head is small, and its agreement with the
    target is all it is for), bfloat16 as asked; float32 leaves them. Its cost per drafted token is then mostly its
    weights' bytes, a quarter of float32's."""
    if mode == "float32":
        return
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, _head_linear(mode, child))


def _head_linear(mode: str, linear: torch.nn.Linear) -> torch.nn.Module:
    if linear.bias is not None:
        raise ValueError("a draft head's Linear layers have no bias")
    if mode == "gguf":
        return block_linear.BlockLinear.from_blocks(BlockWeights.int8_symmetric(linear.weight))
    if mode == "bfloat16":
        return Bf16Linear(linear.weight)
    return Int8Linear.from_weight(linear.weight)
