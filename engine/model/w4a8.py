"""`--weights w4a8`: a GGUF's 4-bit blocks multiplied as llama.cpp multiplies them, in integers.

Each Linear keeps its weights as 4-bit codes in blocks of 32 inputs with a float32 scale and minimum per block (a
Q4_0/Q4_1 GGUF's own blocks, exactly; other weights are rounded to 16 levels per block by range) and the output layer
as 8-bit codes per block of 32 (a Q8_0 GGUF's own blocks). Each row of activations is rounded to 8 bits per block of
32 (scale max|x| / 127), and the products are summed in int32 with AVX512-VNNI (engine/model/csrc/w4a8_linear.cpp):
where torch's int4 kernel spends float multiply-adds per weight and per row, the integer dot products make verifying
16 drafted tokens cost little more than decoding one. The served model is the one these weights and this rounding make
(speculation is exact against plain decoding of it, tests/engine/test_w4a8.py), as close to the GGUF as llama.cpp's
own CPU path, which rounds activations the same way.

The kernel needs AVX512-VNNI and a C++ compiler to build it (engine/model/cpu_kernels.py): `available()` says whether
it runs here, and `--weights auto` picks it only then.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.cpu_kernels import has_vnni

TILE = 16  # output channels per tile of the packed layout
BLOCK = 32  # inputs per block


def available() -> bool:
    """Whether the kernel (engine/model/cpu_kernels.py) builds and runs on this CPU."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and has_vnni()


class W4A8Linear(torch.nn.Module):
    """w[n, k] = scale[n, b] * code[n, k] + min[n, b] for b = k // 32, codes of BITS (4 or 8), in the kernel's tiles."""

    def __init__(self, codes: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                 out_features: int | None = None) -> None:
        super().__init__()
        if not has_vnni():  # loading the kernels registers torch.ops.specserve.w4a8_linear
            raise RuntimeError("--weights w4a8 needs a CPU with AVX512-VNNI and a C++ compiler to build its kernel")
        self.register_buffer("codes", codes)  # [N / 16, K / 32, 64 * bits] int8
        self.register_buffer("shift", shift)  # [N / 16, K / 32, 16] int32: 128 * sum of each block's codes
        self.register_buffer("scale", scale)  # [N / 16, K / 32, 16] float32
        self.register_buffer("minimum", minimum)  # [N / 16, K / 32, 16] float32
        self.bits = bits
        self.out_features = out_features or scale.shape[0] * TILE  # fewer when the last tile is padded

    @classmethod
    def from_blocks(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int) -> W4A8Linear:
        """codes [N, K] integers (0..15 for 4 bits, -127..127 for 8); scale, minimum [N, K / 32]. An N that is not a
        multiple of 16 (an odd vocabulary) is padded with zero weights whose outputs are dropped."""
        num_out, num_in = codes.shape
        if num_in % BLOCK:
            raise ValueError(f"--weights w4a8 needs layers whose inputs are a multiple of {BLOCK}, got {num_in}")
        pad = -num_out % TILE
        codes, scale, minimum = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scale, minimum))
        tiles, blocks = (num_out + pad) // TILE, num_in // BLOCK
        by_block = codes.to(torch.int32).reshape(tiles, TILE, blocks, BLOCK)
        shift = (128 * by_block.sum(-1)).to(torch.int32).permute(0, 2, 1).contiguous()
        # [tile, block, group of 4 inputs, channel, input] as the VNNI instruction reads 16 channels x 4 inputs
        grouped = by_block.reshape(tiles, TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4).to(torch.int8)
        if bits == 4:
            grouped = grouped[:, :, :4] | (grouped[:, :, 4:] << 4)  # groups j and j + 4 share bytes: low, high nibble
        packed = grouped.reshape(tiles, blocks, -1).contiguous()
        return cls(packed, shift, _tiled(scale, tiles), _tiled(minimum, tiles), bits, out_features=num_out)

    @classmethod
    def int8_from_weight(cls, weight: torch.Tensor) -> W4A8Linear:
        """8-bit codes per block of 32, symmetric (d = max|w| / 127): a Q8_0 tensor's dequantized weights give its own
        codes back up to the scale's rounding (d is recomputed in float32, not read as the file's float16)."""
        blocks = weight.float().reshape(weight.shape[0], -1, BLOCK)
        scale = blocks.abs().amax(-1) / 127
        codes = torch.round(blocks / scale.clamp_min(1e-30)[..., None]).clamp(-127, 127)
        return cls.from_blocks(codes.reshape(weight.shape), scale, torch.zeros_like(scale), bits=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float().contiguous()
        out = torch.ops.specserve.w4a8_linear(rows, self.codes, self.shift, self.scale, self.minimum, self.bits)
        if out.shape[1] != self.out_features:
            out = out[:, :self.out_features]
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)


def concatenate(parts: list[W4A8Linear]) -> W4A8Linear:
    """Output channels of PARTS in order: whole tiles, so their buffers concatenate."""
    if len({p.bits for p in parts}) != 1 or any(p.out_features % TILE for p in parts):
        raise ValueError("w4a8 Linear layers fuse when they have the same bit width and whole tiles of 16 channels")
    buffers = [torch.cat([getattr(p, name) for p in parts]) for name in ("codes", "shift", "scale", "minimum")]
    return W4A8Linear(*buffers, bits=parts[0].bits)


def _tiled(per_block: torch.Tensor, tiles: int) -> torch.Tensor:
    """[N, K / 32] -> [N / 16, K / 32, 16] float32."""
    return per_block.float().reshape(tiles, TILE, -1).permute(0, 2, 1).contiguous()
