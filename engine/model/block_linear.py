"""Linear layers whose weights stay in a GGUF's own blocks, multiplied as llama.cpp multiplies them: in integers.

The weights are `BlockWeights` (engine/model/blocks.py): unsigned 4- or 5-bit codes with a scale and a minimum per
block of 32 inputs, or signed 8-bit codes with a scale per 32 or per 16 inputs. Each row of activations is rounded
to 8 bits per block of 32 (scale max|x| / 127), and the products are summed in int32 with AVX512-VNNI or, on CPUs
without it, AVX2 (engine/model/csrc/block_linear.cpp); the float32 steps that combine the blocks are the same, in the
same order, on both, so the two give the same bits and a row's output never depends on the rows beside it. Where
torch's kernels spend float multiply-adds per weight and per row, the integer dot products read each weight byte
once per 4 rows, which makes verifying drafted tokens cost little more than decoding one.

The weights are packed once, at load, into the kernel's tiles: per 16 output channels and block of 32 inputs, 8
groups of 4 inputs as 64-byte vectors of 16 channels x 4 codes (4-bit codes: groups j and j + 4 in the low and high
nibbles of the same bytes), beside the block's scales [32 / sub][16] and, unsigned, its minimums [16]: float16 where
every scale and minimum of the layer is exactly a half (a GGUF stores Q4_0's, Q4_1's, Q5_0's and Q8_0's so), which
cuts the bytes a decoding step reads by a sixth for 4-bit codes (the kernel converts them back to the same floats),
else float32 (Q4_K's and Q6_K's scales are products of a half and a sub-scale). Signed codes
that all lie in -32..31 (Q5_0's, Q6_K's) are stored the same way and passed to the kernel as bits 6, which lets AVX2
multiply them as small unsigned numbers (half the instructions of the sign trick full-range codes need).

The kernel needs AVX2 (at least) and a C++ compiler (engine/model/cpu_kernels.py): `available()` says whether it runs
here, SPECSERVE_CPU_ISA included.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.blocks import BLOCK, BlockWeights
from engine.model.cpu_kernels import cpu_isa, isa_supported

TILE = 16  # output channels per tile of the packed layout
GROUP = 4  # inputs per group: one 32-bit lane of the integer dot-product instructions
NARROW = (-32, 31)  # signed codes in this range take AVX2's cheaper product (kernel bits 6)


def available() -> bool:
    """Whether the kernel (engine/model/cpu_kernels.py) builds and runs on this CPU, within SPECSERVE_CPU_ISA."""
    return cpu_isa() is not None


class BlockLinear(torch.nn.Module):
    """y = x w^T for w in BlockWeights' form, packed into the kernel's tiles (from_blocks)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, sub: int,
                 out_features: int | None = None, isa: str | None = None) -> None:
        super().__init__()
        self.isa = isa or cpu_isa()
        if self.isa is None or not isa_supported(self.isa):  # loading the kernels registers the op
            raise RuntimeError(f"block-quantised Linear layers need a CPU with {isa or 'AVX2 or AVX512-VNNI'}, a C++ "
                               "compiler to build their kernel, and SPECSERVE_CPU_ISA not 'none'")
        self.register_buffer("codes", codes)  # [N / 16, K / 32, 256 (bits 4) or 512] uint8
        self.register_buffer("scales", scales)  # [N / 16, K / 32, 32 / sub, 16] float32 or float16
        self.register_buffer("mins", mins)  # [N / 16, K / 32, 16] of the scales' dtype, or None (signed codes)
        self.bits = bits  # unsigned: 4 or 8; signed: 8, or 6 where every code lies in -32..31 (NARROW)
        self.sub = sub
        self.out_features = out_features or codes.shape[0] * TILE  # fewer when the last tile is padded
        self.in_features = codes.shape[1] * BLOCK

    @classmethod
    def from_blocks(cls, weights: BlockWeights, isa: str | None = None) -> BlockLinear:
        """WEIGHTS packed into tiles. An N that is not a multiple of 16 (an odd vocabulary) is padded with zero
        weights whose outputs are dropped. ISA picks the kernel's variant (default: cpu_isa())."""
        code_range = _check(weights)
        num_out, num_in = weights.shape
        pad = -num_out % TILE
        tiles, blocks = (num_out + pad) // TILE, num_in // BLOCK
        codes = F.pad(weights.codes.to(torch.int16), (0, 0, 0, pad)).to(torch.int8 if weights.signed else torch.uint8)
        # [tile, block, group of 4 inputs, channel, input]: the 64-byte vectors the dot-product instructions read
        grouped = codes.view(torch.uint8).reshape(tiles, TILE, blocks, BLOCK // GROUP, GROUP).permute(0, 2, 3, 1, 4)
        if weights.bits == 4:
            grouped = grouped[:, :, :4] | (grouped[:, :, 4:] << 4)  # groups j and j + 4 share bytes: low, high nibble
        packed = grouped.reshape(tiles, blocks, -1).contiguous()
        scales = _tiled(weights.scales, tiles, BLOCK // weights.sub)
        mins = None if weights.signed else _tiled(weights.mins, tiles, 1).reshape(tiles, blocks, TILE)
        scales, mins = _stored(scales, mins)
        return cls(packed, scales, mins, _kernel_bits(weights, code_range), weights.sub, out_features=num_out, isa=isa)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float().contiguous()
        out = torch.ops.specserve.block_linear(rows, self.codes, self.scales, self.mins, self.bits, self.sub, self.isa)
        if out.shape[1] != self.out_features:
            out = out[:, :self.out_features]
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        form = f"signed, bits={self.bits}, sub={self.sub}" if self.mins is None else f"unsigned, bits={self.bits}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {form}, isa={self.isa}"


def concatenate(parts: list[BlockLinear]) -> BlockLinear:
    """Output channels of PARTS in order, as one layer (one kernel call): whole tiles, so their buffers concatenate."""
    first = parts[0]
    bits = max(p.bits for p in parts)  # narrow signed codes beside full ones: all multiplied as full ones
    same_form = {(p.mins is None, p.bits if p.mins is not None else 8, p.sub, p.in_features, p.isa) for p in parts}
    if len(same_form) != 1 or any(p.out_features % TILE for p in parts):
        raise ValueError("block-quantised Linear layers fuse only with the same form, bits, sub, inputs and ISA, and "
                         f"whole tiles of {TILE} output channels")
    dtype = torch.float16 if all(p.scales.dtype == torch.float16 for p in parts) else torch.float32
    codes = torch.cat([p.codes for p in parts])
    scales = torch.cat([p.scales.to(dtype) for p in parts])
    mins = None if first.mins is None else torch.cat([p.mins.to(dtype) for p in parts])
    return BlockLinear(codes, scales, mins, bits, first.sub, isa=first.isa)


def _check(weights: BlockWeights) -> tuple[int, int] | None:
    """The codes' least and greatest values (None: no codes); ValueError unless WEIGHTS are a form the kernel
    multiplies exactly (the code ranges keep AVX2's int16 products from saturating)."""
    num_out, num_in = weights.shape
    if num_in % BLOCK:
        raise ValueError(f"block-quantised Linear layers need inputs in whole blocks of {BLOCK}, got {num_in}")
    if weights.signed:
        form, low, high = (weights.bits == 8 and weights.sub in (16, 32)), -128, 127
    else:
        form, low, high = (weights.bits in (4, 8) and weights.sub == BLOCK), 0, 15 if weights.bits == 4 else 31
    if not form:
        raise ValueError(f"no kernel for {'signed' if weights.signed else 'unsigned'} codes of bits={weights.bits}, "
                         f"sub={weights.sub} (unsigned: bits 4 or 8, sub 32; signed: bits 8, sub 16 or 32)")
    if weights.codes.dtype.is_floating_point or weights.codes.dtype == torch.bool:
        raise ValueError(f"codes must be integers, got {weights.codes.dtype}")
    code_range = (int(weights.codes.min()), int(weights.codes.max())) if weights.codes.numel() else None
    if code_range is not None and not low <= code_range[0] <= code_range[1] <= high:
        raise ValueError(f"codes must lie in {low}..{high} for this form")
    if weights.scales.shape != (num_out, num_in // weights.sub):
        raise ValueError(f"scales must be [{num_out}, {num_in // weights.sub}], got {list(weights.scales.shape)}")
    if weights.mins is not None and weights.mins.shape != (num_out, num_in // BLOCK):
        raise ValueError(f"mins must be [{num_out}, {num_in // BLOCK}], got {list(weights.mins.shape)}")
    return code_range


def _kernel_bits(weights: BlockWeights, code_range: tuple[int, int] | None) -> int:
    """The bits the kernel is told: signed codes whose CODE_RANGE lies in NARROW (Q5_0's, Q6_K's) are 6, which lets
    AVX2 multiply them as small unsigned numbers (engine/model/csrc/block_linear.cpp); otherwise the weights' own."""
    if weights.signed and code_range is not None and NARROW[0] <= code_range[0] <= code_range[1] <= NARROW[1]:
        return 6
    return weights.bits


def _stored(scales: torch.Tensor, mins: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SCALES and MINS (None: signed codes) as the kernel reads them: float16 where each of them is exactly a half,
    else float32 as they are."""
    if all(torch.equal(t.half().float(), t) for t in (scales, mins) if t is not None):
        return scales.half(), None if mins is None else mins.half()
    return scales, mins


def _tiled(per_scale: torch.Tensor, tiles: int, per_block: int) -> torch.Tensor:
    """[N, K / sub] -> [N / 16, K / 32, 32 / sub, 16] float32, the padded channels zero."""
    padded = F.pad(per_scale.float(), (0, 0, 0, tiles * TILE - per_scale.shape[0]))
    return padded.reshape(tiles, TILE, -1, per_block).permute(0, 2, 3, 1).contiguous()
