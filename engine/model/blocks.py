"""A weight matrix as integer codes in blocks of inputs, the form a GGUF stores it in and the integer kernels
(engine/model/block_linear.py) multiply.

Two forms cover every common GGUF block type (engine/model/gguf_blocks.py maps each onto one, exactly):
- unsigned, with minimums: w[n, k] = scales[n, k // 32] * codes[n, k] + mins[n, k // 32], codes 0 .. 2**bits - 1
  (Q4_0, Q4_1, Q4_K with bits 4; Q5_1, Q5_K with bits 8, codes 0..31);
- signed, symmetric: w[n, k] = scales[n, k // sub] * codes[n, k], codes -128..127 in bytes (Q8_0, Q5_0 and Q6_K, the
  last with a scale per 16 inputs: sub 16).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # inputs per block: a GGUF block, a k-quant's sub-block


@dataclass
class BlockWeights:
    codes: torch.Tensor  # [N, K] integer codes (any integer dtype)
    scales: torch.Tensor  # [N, K // sub] float32
    mins: torch.Tensor | None  # [N, K // 32] float32; None for the signed form
    bits: int  # 4 (codes 0..15, unsigned only) or 8 (one byte per code)
    sub: int = BLOCK  # inputs per scale: 32, or 16 (signed only)

    @property
    def signed(self) -> bool:
        return self.mins is None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: scale * code (+ min), in float32."""
        scales = self.scales.float().repeat_interleave(self.sub, dim=1)
        weight = scales * self.codes.float()
        if self.mins is not None:
            weight = weight + self.mins.float().repeat_interleave(BLOCK, dim=1)
        return weight

    def rows(self, order) -> BlockWeights:
        """The same weights with their output rows in ORDER (whole rows move; blocks stay intact)."""
        return BlockWeights(self.codes[order], self.scales[order], None if self.mins is None else self.mins[order],
                            self.bits, self.sub)

    @classmethod
    def by_range(cls, weight: torch.Tensor) -> BlockWeights:
        """4-bit unsigned codes: each block of 32 rounded to 16 levels between its minimum and maximum (for weights
        stored as floats or in a type without a kernel)."""
        blocks = weight.float().reshape(weight.shape[0], -1, BLOCK)
        low, high = blocks.amin(-1), blocks.amax(-1)
        step = ((high - low) / 15).clamp_min(1e-12)
        codes = torch.round((blocks - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.uint8)
        return cls(codes.reshape(weight.shape), step, low, bits=4)

    @classmethod
    def int8_symmetric(cls, weight: torch.Tensor) -> BlockWeights:
        """8-bit signed codes per block of 32, d = max|w| / 127 (an output layer stored as floats)."""
        blocks = weight.float().reshape(weight.shape[0], -1, BLOCK)
        scale = blocks.abs().amax(-1) / 127
        codes = torch.round(blocks / scale.clamp_min(1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(codes.reshape(weight.shape), scale, None, bits=8)
