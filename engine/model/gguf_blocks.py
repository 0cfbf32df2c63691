"""A GGUF tensor's quantized blocks as `BlockWeights` (engine/model/blocks.py): the same integer codes and the same
float32 scales and minimums llama.cpp dequantizes with, so the integer kernels multiply the weights the file holds
without requantising them.

Each type's raw bytes are read through a numpy structured dtype (one record per GGUF block, fields as in llama.cpp's
block_* structs) and decoded for all blocks at once; a tensor of millions of blocks maps in a fraction of a second.
Scales and minimums are fp16 -> float32 and then products in float32, in llama.cpp's order, so
`BlockWeights.dequantize()` equals gguf-py's `gguf.quants.dequantize` bit for bit. The one difference is Q4_0:
llama.cpp computes d * (q - 8) where the form computes d * q + (-8 d); both terms and the sum are exact in float32
(an 11-bit d times a 4-bit code), so only the sign of a zero weight can differ (+0 here, where llama.cpp's product
gives -0 for a negative d with q = 8, or a zero d with q < 8).

| type | llama.cpp weight                 | form     | bits | codes    | scales (per)    | mins (per 32)  |
|------|----------------------------------|----------|------|----------|-----------------|----------------|
| Q4_0 | d (q - 8)                        | unsigned | 4    | q 0..15  | d (32)          | -8 d           |
| Q4_1 | d q + m                          | unsigned | 4    | q 0..15  | d (32)          | m              |
| Q5_0 | d (q - 16)                       | signed   | 8    | q - 16   | d (32)          | -              |
| Q5_1 | d q + m                          | unsigned | 8    | q 0..31  | d (32)          | m              |
| Q8_0 | d q                              | signed   | 8    | q        | d (32)          | -              |
| Q4_K | d sc_j q - dmin m_j              | unsigned | 4    | q 0..15  | d sc_j (32)     | -(dmin m_j)    |
| Q5_K | d sc_j q - dmin m_j              | unsigned | 8    | q 0..31  | d sc_j (32)     | -(dmin m_j)    |
| Q6_K | d sc_j (q - 32)                  | signed   | 8    | q - 32   | d sc_j (16)     | -              |

Other types (F32, F16, BF16, Q2_K, Q3_K, the IQ types, ...) map to None.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.model.blocks import BlockWeights

_F16 = "<f2"
_QH_SHIFTS_Q5K = np.arange(8, dtype=np.uint8)[:, None]  # bit j of each qh byte: the high bit of sub-block j
_QH_SHIFTS_Q6K = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]  # 2 bits of each qh byte per 32 inputs


def _f32(field: np.ndarray) -> np.ndarray:
    """An fp16 field of every block as float32 (exact), as llama.cpp's GGML_FP16_TO_FP32."""
    return field.astype(np.float32)


def _nibbles(packed: np.ndarray, width: int) -> np.ndarray:
    """Bytes [..., n] as 2n 4-bit codes: each run of WIDTH bytes gives WIDTH low nibbles, then the same bytes'
    WIDTH high nibbles (llama.cpp's order: width 16 for Q4_0/Q4_1/Q5_*, 32 for Q4_K/Q5_K, 64 for Q6_K's ql)."""
    lead = packed.shape[:-1]
    runs = packed.reshape(*lead, -1, width)
    out = np.empty((*runs.shape[:-1], 2, width), dtype=np.uint8)
    np.bitwise_and(runs, 0x0F, out=out[..., 0, :])
    np.right_shift(runs, 4, out=out[..., 1, :])
    return out.reshape(*lead, -1)


def _add_high_bits(codes: np.ndarray, high: np.ndarray) -> np.ndarray:
    """CODES | HIGH << 4, in place: a 5- or 6-bit code from its low nibble and its high bit(s)."""
    np.left_shift(high, 4, out=high)
    np.bitwise_or(codes, high, out=codes)
    return codes


def _centred(codes: np.ndarray, offset: int) -> np.ndarray:
    """Unsigned codes 0..2*OFFSET-1 as signed int8 codes -OFFSET..OFFSET-1, in place."""
    signed = codes.view(np.int8)
    np.subtract(signed, np.int8(offset), out=signed)
    return signed


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and minimums of Q4_K/Q5_K from their 12 bytes, as llama.cpp's get_scale_min_k4: bytes
    0..3 hold scales 0..3 (low 6 bits) and the top 2 bits of scales 4..7; bytes 4..7 the same for the minimums;
    bytes 8..11 the low 4 bits of scale j+4 (low nibble) and minimum j+4 (high nibble)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales, mins


def _q4_0(blocks: np.ndarray) -> tuple:
    d = _f32(blocks["d"])
    return _nibbles(blocks["qs"], 16), d, np.float32(-8) * d, 4, 32


def _q4_1(blocks: np.ndarray) -> tuple:
    return _nibbles(blocks["qs"], 16), _f32(blocks["d"]), _f32(blocks["m"]), 4, 32


def _q5_codes(blocks: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31: input j's low nibble, and its high bit as bit j of the little-endian 32-bit qh."""
    high = np.unpackbits(blocks["qh"], axis=-1, bitorder="little")
    return _add_high_bits(_nibbles(blocks["qs"], 16), high)


def _q5_0(blocks: np.ndarray) -> tuple:
    return _centred(_q5_codes(blocks), 16), _f32(blocks["d"]), None, 8, 32


def _q5_1(blocks: np.ndarray) -> tuple:
    return _q5_codes(blocks), _f32(blocks["d"]), _f32(blocks["m"]), 8, 32


def _q8_0(blocks: np.ndarray) -> tuple:
    return np.array(blocks["qs"], dtype=np.int8), _f32(blocks["d"]), None, 8, 32


def _k_scales_and_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K per 32 inputs: scales d * sc_j and minimums -(dmin * m_j), float32 products as llama.cpp's
    d1 = d * sc, m1 = min * m (its weight d1 * q - m1 is the form's d1 * q + (-m1), the same float32 operation)."""
    sc, m = _k_scales(blocks["scales"])
    scales = _f32(blocks["d"])[..., None] * sc.astype(np.float32)
    mins = -(_f32(blocks["dmin"])[..., None] * m.astype(np.float32))
    return scales, mins


def _q4_k(blocks: np.ndarray) -> tuple:
    scales, mins = _k_scales_and_mins(blocks)
    return _nibbles(blocks["qs"], 32), scales, mins, 4, 32


def _q5_k(blocks: np.ndarray) -> tuple:
    """Codes 0..31: Q4_K's nibbles, plus bit j of qh[l] as the high bit of input 32 j + l."""
    scales, mins = _k_scales_and_mins(blocks)
    qh = blocks["qh"]
    high = ((qh[..., None, :] >> _QH_SHIFTS_Q5K) & 1).reshape(*qh.shape[:-1], -1)
    return _add_high_bits(_nibbles(blocks["qs"], 32), high), scales, mins, 8, 32


def _q6_k(blocks: np.ndarray) -> tuple:
    """Codes q - 32, q 0..63: each half of 128 inputs takes 64 ql bytes' low then high nibbles, and its 32 qh bytes'
    bits 2s..2s+1 as the top 2 bits of inputs 32 s + l; scale j (int8) covers inputs 16 j .. 16 j + 15."""
    qh = blocks["qh"]
    halves = qh.reshape(*qh.shape[:-1], 2, 1, 32)
    high = ((halves >> _QH_SHIFTS_Q6K) & 3).reshape(*qh.shape[:-1], -1)
    codes = _centred(_add_high_bits(_nibbles(blocks["ql"], 64), high), 32)
    scales = _f32(blocks["d"])[..., None] * blocks["scales"].astype(np.float32)
    return codes, scales, None, 8, 16


_Decoder = Callable[[np.ndarray], tuple]
_LAYOUTS: dict[GGMLQuantizationType, tuple[np.dtype, _Decoder]] = {  # one block's fields, in llama.cpp's order
    GGMLQuantizationType.Q4_0: (np.dtype([("d", _F16), ("qs", "u1", 16)]), _q4_0),
    GGMLQuantizationType.Q4_1: (np.dtype([("d", _F16), ("m", _F16), ("qs", "u1", 16)]), _q4_1),
    GGMLQuantizationType.Q5_0: (np.dtype([("d", _F16), ("qh", "u1", 4), ("qs", "u1", 16)]), _q5_0),
    GGMLQuantizationType.Q5_1: (np.dtype([("d", _F16), ("m", _F16), ("qh", "u1", 4), ("qs", "u1", 16)]), _q5_1),
    GGMLQuantizationType.Q8_0: (np.dtype([("d", _F16), ("qs", "i1", 32)]), _q8_0),
    GGMLQuantizationType.Q4_K: (np.dtype([("d", _F16), ("dmin", _F16), ("scales", "u1", 12), ("qs", "u1", 128)]),
                                _q4_k),
    GGMLQuantizationType.Q5_K: (np.dtype([("d", _F16), ("dmin", _F16), ("scales", "u1", 12), ("qh", "u1", 32),
                                          ("qs", "u1", 128)]), _q5_k),
    GGMLQuantizationType.Q6_K: (np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", _F16)]),
                                _q6_k),
}
for _kind, (_fields, _) in _LAYOUTS.items():  # the records are exactly llama.cpp's block sizes
    assert _fields.itemsize == GGML_QUANT_SIZES[_kind][1], _kind

BLOCK_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_LAYOUTS)


def _raw_rows(tensor, row_order) -> np.ndarray:
    """The tensor's bytes as [rows, bytes per row] uint8 (a GGUFReader tensor's data already is), rows in ROW_ORDER:
    reordering the raw rows moves whole output rows and costs less than moving their decoded codes."""
    raw = np.asarray(tensor.data)
    if raw.dtype != np.uint8:
        raise ValueError(f"{tensor.tensor_type.name} data must be raw uint8 blocks, not {raw.dtype}")
    raw = raw.reshape(-1, raw.shape[-1])  # a 1-D tensor is one row
    if row_order is not None:
        raw = raw[np.asarray(row_order)]
    return np.ascontiguousarray(raw)


def block_weights(tensor, row_order: np.ndarray | None = None) -> BlockWeights | None:
    """A GGUF tensor (a `gguf.ReaderTensor`, or anything with its .tensor_type and .data of raw [rows, bytes] uint8)
    as BlockWeights that dequantize to exactly its llama.cpp weights; None for types not in BLOCK_TYPES. ROW_ORDER
    (an index array, e.g. weights.llama_row_order) reorders whole output rows, as transformers does for q/k."""
    layout = _LAYOUTS.get(tensor.tensor_type)
    if layout is None:
        return None
    fields, decode = layout
    raw = _raw_rows(tensor, row_order)
    if raw.shape[1] % fields.itemsize:
        raise ValueError(f"{tensor.tensor_type.name} rows of {raw.shape[1]} bytes are not whole {fields.itemsize}-byte "
                         "blocks")
    codes, scales, mins, bits, sub = decode(raw.view(fields))
    rows = raw.shape[0]
    return BlockWeights(codes=torch.from_numpy(codes.reshape(rows, -1)),
                        scales=torch.from_numpy(scales.reshape(rows, -1)),
                        mins=None if mins is None else torch.from_numpy(mins.reshape(rows, -1)), bits=bits, sub=sub)
