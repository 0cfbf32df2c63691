"""A GGUF file's tensors, read in a fraction of a second however large its vocabulary.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array: Gemma 3's 262k-token vocabulary
(its strings, scores and token types) takes it about 20 s, SmolLM2's 49k about 8 s, on every start-up. The engine
needs the tensors only (it reads the config and tokenizer from the files transformers writes once per GGUF), so
`TensorReader` steps over the metadata arrays by their lengths and keeps only the scalar fields (the alignment among
them); the tensors are GGUFReader's own, built by its code from the same offsets.
"""
from __future__ import annotations

import struct
import sys
from functools import cache

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

_SCALAR_SIZES = {  # bytes of each fixed-size metadata value
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


class TensorReader(GGUFReader):
    """GGUFReader whose metadata arrays are skipped, not parsed (`fields` holds the scalars and strings only)."""

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I" or sys.byteorder != "little":
            return super()._build_fields(offs, count)
        header = memoryview(self.data)
        for _ in range(count):
            key_start = offs
            key_length, = struct.unpack_from("<Q", header, offs)
            key = bytes(header[offs + 8:offs + 8 + key_length]).decode()
            offs += 8 + key_length
            value_type = GGUFValueType(struct.unpack_from("<I", header, offs)[0])
            offs += 4
            if value_type == GGUFValueType.ARRAY:
                offs = _after_array(header, offs)
                continue
            size, parts, indices, types = self._get_field_parts(offs, value_type)
            key_parts = [self._get(key_start, np.uint64), self._get(key_start + 8, np.uint8, key_length),
                         self._get(offs - 4, np.uint32)]
            self._push_field(ReaderField(key_start, key, key_parts + parts, [i + 3 for i in indices], types),
                             skip_sum=True)
            offs += size
        return offs


def _after_array(header: memoryview, offs: int) -> int:
    """The offset just past the metadata array that starts at OFFS (its item type, length, then its items)."""
    item_type = GGUFValueType(struct.unpack_from("<I", header, offs)[0])
    length, = struct.unpack_from("<Q", header, offs + 4)
    offs += 12
    if item_type in _SCALAR_SIZES:
        return offs + length * _SCALAR_SIZES[item_type]
    if item_type == GGUFValueType.STRING:
        for _ in range(length):
            offs += 8 + struct.unpack_from("<Q", header, offs)[0]
        return offs
    if item_type == GGUFValueType.ARRAY:
        for _ in range(length):
            offs = _after_array(header, offs)
        return offs
    raise ValueError(f"unknown GGUF metadata type {item_type}")


@cache
def gguf_tensors(path: str) -> dict:
    """The GGUF's tensors (`gguf.ReaderTensor`) by name, memory-mapped; read once per process."""
    return {tensor.name: tensor for tensor in TensorReader(path).tensors}
