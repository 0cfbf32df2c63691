"""`--weights w4a8`: a GGUF's 4-bit blocks multiplied as llama.cpp multiplies them, in integers.

Each Linear keeps its weights as 4-bit codes in blocks of 32 inputs with a float32 scale and minimum per block (a
Q4_0/Q4_1 GGUF's own blocks, exactly; other weights are rounded to 16 levels per block by range) and the output layer
as 8-bit codes per block of 32 (a Q8_0 GGUF's own blocks). Each row of activations is rounded to 8 bits per block of
32 (scale max|x| / 127), and the products are summed in int32 with AVX512-VNNI (engine/csrc/w4a8_linear.cpp): where
torch's int4 kernel spends float multiply-adds per weight and per row, the integer dot products make verifying 16
drafted tokens cost little more than decoding one. The served model is the one these weights and this rounding make
(speculation is exact against plain decoding of it, tests/engine/test_w4a8.py), as close to the GGUF as llama.cpp's
own CPU path, which rounds activations the same way.

The kernel is compiled on first use for the host (a C++ compiler and ninja; ~1 min, once, cached under the user
cache) and needs AVX512-VNNI: `available()` says whether it can run here, and `--weights auto` picks it only then.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger("specserve.engine")
SOURCE = Path(__file__).parent / "csrc" / "w4a8_linear.cpp"
TILE = 16  # output channels per tile of the packed layout
BLOCK = 32  # inputs per block
# -fopenmp: at::parallel_for is a header template that splits the tiles over torch's OpenMP threads only when the
# extension is compiled with OpenMP; it then links the libgomp.so.1 that torch has already loaded (same soname)
CFLAGS = ("-O3", "-fopenmp")


@cache
def kernel():
    """The compiled extension, or None where this host cannot build or run it (the reason is logged)."""
    from torch.utils.cpp_extension import load

    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # the venv's ninja
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + torch.__version__.encode() + repr(CFLAGS).encode()).hexdigest()[:12]
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    build_dir = cache_root / "specserve" / "kernels" / f"w4a8-{tag}"
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.info("compiling the w4a8 kernel for this CPU into %s (once, about a minute)", build_dir)
    try:
        module = load(name="specserve_w4a8", sources=[str(SOURCE)], build_directory=str(build_dir),
                      extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # no compiler, no ninja, or a failed build: the other weight modes still serve
        logger.warning("the w4a8 kernel could not be built here (%s); --weights w4a8 is unavailable", error)
        return None
    if not module.supported():
        logger.info("this CPU has no AVX512-VNNI: --weights w4a8 is unavailable")
        return None
    return module


def available() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and kernel() is not None


class W4A8Linear(torch.nn.Module):
    """w[n, k] = scale[n, b] * code[n, k] + min[n, b] for b = k // 32, codes of BITS (4 or 8), in the kernel's tiles."""

    def __init__(self, codes: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                 out_features: int | None = None) -> None:
        super().__init__()
        if kernel() is None:  # it registers torch.ops.specserve.w4a8_linear
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
