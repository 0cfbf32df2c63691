"""How the target's Linear layers keep and multiply their weights: `--weights auto|float32|bfloat16|int8|int4|w4a8`.

- float32: the weights as loaded (a GGUF dequantized exactly to float32).
- bfloat16: weights rounded to bfloat16; each Linear multiplies in bfloat16 (oneDNN).
- int8: weight-only int8, one symmetric scale per output channel, activations in bfloat16 (`_weight_int8pack_mm`).
- int4: weight-only 4-bit in groups of 32 with a scale and a zero per group (`_weight_int4pack_mm_for_cpu`),
  activations in bfloat16. A GGUF's Q4_1 blocks (w = d q + m) map onto it without requantising: scale d, zero m + 8d,
  the same codes; Q4_0 (w = d (q - 8)) with zero 0. Not exact: the kernel takes scales, zeros and activations in
  bfloat16, so d and m lose 3 of their 10 mantissa bits. Other GGUF types, and models that are not GGUF, are
  quantised to 4 bits by each group's range (min to max). The output layer (a GGUF's tied Q8_0 embedding) stays int8.
- w4a8: the same 4-bit blocks (float32 scales and minimums) and a Q8_0 output layer's own 8-bit blocks, activations
  rounded to 8 bits per block of 32 and products summed in integers, as llama.cpp does on the CPU (engine/model/w4a8.py;
  needs AVX512-VNNI).
The served model is the one these weights make: speculation is exact against plain decoding of the same mode
(tests/engine/test_weights.py), not against float32. Norms, attention and the residual stream stay in the model's dtype.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import WEIGHT_MODES  # the choices live with the config, which imports no torch
from engine.model import w4a8

logger = logging.getLogger("specserve.engine")
GROUP_SIZE = 32  # weights per int4 group: a GGUF Q4 block
INT4_CHANNEL_MULTIPLE = 16  # the int4 CPU kernel needs output channels in multiples of 16
INT4_PACK_BLOCK = 64  # it packs output channels in blocks of 64: whole blocks' packings concatenate (tested)
GGUF_LINEARS = {  # transformers' Llama module name -> the GGUF tensor of layer i
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


@dataclass
class Q4Groups:
    """4-bit codes and per-group affine parameters: w[n, k] = scale[n, g] * q[n, k] + min[n, g], g = k // 32."""

    codes: torch.Tensor  # [out, in] int32 in 0..15
    scales: torch.Tensor  # [out, in / 32] float32
    mins: torch.Tensor  # [out, in / 32] float32

    @property
    def zeros(self) -> torch.Tensor:
        """The int4 kernel's zero point, which it adds to scale * (q - 8)."""
        return self.mins + 8 * self.scales

    @classmethod
    def by_range(cls, weight: torch.Tensor) -> Q4Groups:
        """Round each group of 32 to 16 levels between its minimum and maximum (for weights not stored as Q4)."""
        groups = weight.float().reshape(weight.shape[0], -1, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        step = ((high - low) / 15).clamp_min(1e-12)
        codes = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32)
        return cls(codes.reshape(weight.shape), step, low)


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
    def from_groups(cls, groups: Q4Groups) -> Int4Linear:
        return cls.from_codes(groups.codes, torch.stack([groups.scales.T, groups.zeros.T], dim=-1))

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


def gguf_q4_groups(tensor, row_order: np.ndarray | None) -> Q4Groups | None:
    """A GGUF Q4_0 or Q4_1 tensor as Q4Groups, exactly; None for other types. ROW_ORDER undoes llama.cpp's
    q/k row permutation, as transformers does when it loads the weights (whole rows move, blocks stay intact)."""
    from gguf import GGMLQuantizationType

    kind = tensor.tensor_type
    if kind not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        return None
    block_bytes = 18 if kind == GGMLQuantizationType.Q4_0 else 20  # fp16 d (and fp16 m), then 16 bytes of codes
    raw = np.asarray(tensor.data)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block_bytes)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    m = (np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32) if block_bytes == 20
         else None)
    packed = blocks[:, :, block_bytes - 16:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(rows, -1).astype(np.int32)  # low nibbles first
    mins = m if m is not None else -8 * d
    if row_order is not None:
        codes, d, mins = codes[row_order], d[row_order], mins[row_order]
    return Q4Groups(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(d), torch.from_numpy(mins))


def gguf_q8_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A GGUF Q8_0 tensor (w = d q, blocks of 32) as (codes [rows, cols] int32, scales and zero minimums
    [rows, cols / 32] float32), exactly; None for other types."""
    from gguf import GGMLQuantizationType

    if tensor.tensor_type != GGMLQuantizationType.Q8_0:
        return None
    raw = np.asarray(tensor.data)
    blocks = raw.reshape(raw.shape[0], -1, 34)  # float16 d, then 32 signed codes
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
    codes = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(raw.shape[0], -1).astype(np.int32)
    scales = torch.from_numpy(d)
    return torch.from_numpy(codes), scales, torch.zeros_like(scales)


def llama_row_order(num_rows: int, num_heads: int) -> np.ndarray:
    """The rows transformers reads a GGUF q/k weight in (the inverse of llama.cpp's rotary permutation)."""
    return np.arange(num_rows).reshape(num_heads, num_rows // num_heads // 2, 2).swapaxes(2, 1).reshape(-1)


def resolve_weights(mode: str, device: torch.device, gguf_path: str | None) -> str:
    """The mode `auto` stands for. For a GGUF of Q4 weights on a CPU with AVX-512: w4a8 where its kernel builds and
    the CPU has VNNI (verifying drafts costs least there), else int4. Otherwise float32, and on CUDA the model's dtype
    as loaded (float32 names it)."""
    if mode == "w4a8" and not w4a8.available():
        raise ValueError("--weights w4a8 needs a CPU with AVX512-VNNI and a C++ compiler to build its kernel "
                         "(see the log)")
    if mode != "auto":
        return mode
    if device.type != "cpu" or not (gguf_path and gguf_is_q4(gguf_path)):
        return "float32"
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return "float32"
    return "w4a8" if w4a8.available() else "int4"


def gguf_is_q4(path: str) -> bool:
    from gguf import GGMLQuantizationType, GGUFReader

    kinds = {t.tensor_type for t in GGUFReader(path).tensors if t.name.endswith(("attn_q.weight", "ffn_up.weight"))}
    return bool(kinds) and kinds <= {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1}


@torch.no_grad()
def apply_weights(model: torch.nn.Module, mode: str, gguf_path: str | None = None) -> None:
    """Replace the model's Linear layers (and its output layer) by those of MODE; float32 leaves them as they are."""
    if mode == "float32":
        return
    if mode not in WEIGHT_MODES[1:]:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {mode!r}")
    tensors = _gguf_tensors(gguf_path) if mode in ("int4", "w4a8") and gguf_path else {}
    num_exact = 0
    for i, layer in enumerate(model.model.layers):
        for name in GGUF_LINEARS:
            parent_name, child_name = name.split(".")
            parent = getattr(layer, parent_name)
            linear = getattr(parent, child_name)
            replacement, exact = _replacement(
                model.config, mode, linear, tensors.get(f"blk.{i}.{GGUF_LINEARS[name]}.weight"), child_name
            )
            setattr(parent, child_name, replacement)
            num_exact += exact
    model.lm_head = _output_layer(mode, model.lm_head, tensors.get("output.weight") or tensors.get("token_embd.weight"))
    if mode in ("int4", "w4a8"):
        total = len(model.model.layers) * len(GGUF_LINEARS)
        logger.info("%s weights: %d of %d Linear layers mapped from the GGUF's Q4 blocks, the rest rounded by range",
                    mode, num_exact, total)


def _output_layer(mode: str, lm_head: torch.nn.Module, gguf_tensor) -> torch.nn.Module:
    if mode == "bfloat16":
        return Bf16Linear(lm_head.weight)
    if mode != "w4a8":
        return Int8Linear.from_weight(lm_head.weight)
    blocks = gguf_q8_blocks(gguf_tensor) if gguf_tensor is not None else None
    return w4a8.W4A8Linear.from_blocks(*blocks, bits=8) if blocks else w4a8.W4A8Linear.int8_from_weight(lm_head.weight)


def _replacement(config, mode: str, linear: torch.nn.Linear, gguf_tensor, name: str) -> tuple[torch.nn.Module, bool]:
    if linear.bias is not None:
        raise ValueError(f"--weights {mode} supports Linear layers without bias only")
    if mode == "bfloat16":
        return Bf16Linear(linear.weight), False
    if mode == "int8":
        return Int8Linear.from_weight(linear.weight), False
    if linear.out_features % INT4_CHANNEL_MULTIPLE or linear.in_features % GROUP_SIZE:
        raise ValueError(f"--weights {mode} needs layers of multiples of {INT4_CHANNEL_MULTIPLE} x {GROUP_SIZE}")
    groups = None
    if gguf_tensor is not None:
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(name)
        groups = gguf_q4_groups(gguf_tensor, llama_row_order(linear.out_features, heads) if heads else None)
    exact = groups is not None
    groups = groups or Q4Groups.by_range(linear.weight)
    if mode == "w4a8":
        return w4a8.W4A8Linear.from_blocks(groups.codes, groups.scales, groups.mins, bits=4), exact
    return Int4Linear.from_groups(groups), exact


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
    fused, start = _concatenate(parts), 0
    for name, part in zip(names, parts):
        end = start + part.out_features
        setattr(parent, name, OutputSlice(fused, start, end))
        start = end
    return fused


def _concatenate(parts: list[torch.nn.Module]) -> torch.nn.Module:
    kind = type(parts[0])
    if any(type(part) is not kind for part in parts):
        raise ValueError(f"cannot fuse Linear layers of different kinds: {[type(p).__name__ for p in parts]}")
    if kind is Int4Linear:
        scales_and_zeros = torch.cat([p.scales_and_zeros for p in parts], dim=1)
        if all(p.out_features % INT4_PACK_BLOCK == 0 for p in parts):  # whole blocks: the packings concatenate
            return Int4Linear(torch.cat([p.packed for p in parts]), scales_and_zeros)
        return Int4Linear.from_codes(torch.cat([p.codes() for p in parts]), scales_and_zeros)
    if kind.__name__ == "W4A8Linear":
        return w4a8.concatenate(parts)
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


def _gguf_tensors(path: str) -> dict:
    from gguf import GGUFReader

    return {tensor.name: tensor for tensor in GGUFReader(path).tensors}
