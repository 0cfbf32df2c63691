"""The w4a8 kernel: integer dot products of 8-bit activations with 4- or 8-bit weight blocks, the same numbers for a
row whatever rows it is computed with, and a GGUF's blocks taken as they are stored."""
import pytest
import torch

from engine.model.w4a8 import W4A8Linear, available, concatenate
from engine.model.weights import Q4Groups, gguf_q8_blocks

pytestmark = pytest.mark.skipif(
    not available(), reason="--weights w4a8 needs AVX512-VNNI and a C++ compiler for its kernel"
)


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: each row's blocks of 32 rounded to 8 bits (d = max|x| / 127), then
    sum_b d_b (scale[n, b] sum_k q_k code[n, k] + min[n, b] sum_k q_k)."""
    rows, num_in = x.shape
    blocks = x.reshape(rows, num_in // 32, 32)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).double()
    dots = torch.einsum("mbk,nbk->mnb", q, codes.double().reshape(codes.shape[0], -1, 32))
    per_block = dots * scale.double() + minimum.double() * q.sum(-1)[:, None, :]
    return (per_block * d.double()[:, None, :]).sum(-1)


def random_layer(num_out: int, num_in: int, bits: int, seed: int) -> tuple[W4A8Linear, tuple]:
    generator = torch.Generator().manual_seed(seed)
    if bits == 4:
        groups = Q4Groups.by_range(torch.randn(num_out, num_in, generator=generator))
        blocks = (groups.codes, groups.scales, groups.mins)
    else:
        codes = torch.randint(-127, 128, (num_out, num_in), generator=generator)
        scale = torch.rand(num_out, num_in // 32, generator=generator) / 100
        blocks = (codes, scale, torch.zeros_like(scale))
    return W4A8Linear.from_blocks(*blocks, bits=bits), blocks


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(64, 96), (40, 32), (960, 576)])  # 40: a last tile padded
def test_the_kernel_computes_the_integer_arithmetic_it_claims(bits, shape):
    layer, blocks = random_layer(*shape, bits=bits, seed=sum(shape) + bits)
    x = torch.randn(13, shape[1], generator=torch.Generator().manual_seed(1))
    x[2, :32] = 0  # a block of zeros: scale 0, no division by it
    out = layer(x)
    expected = reference(x, *blocks)
    assert out.shape == (13, shape[0])
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(bits):
    """Rows alone, in groups of 4 (the kernel's row blocking) and in partial groups give bit-identical outputs."""
    layer, _ = random_layer(128, 192, bits=bits, seed=3)
    x = torch.randn(11, 192, generator=torch.Generator().manual_seed(2))
    whole = layer(x)
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(11)]), whole)
    for start, end in ((0, 4), (1, 4), (3, 10), (5, 11)):
        assert torch.equal(layer(x[start:end]), whole[start:end])


def test_fused_layers_give_their_parts_outputs():
    parts = [random_layer(num_out, 64, bits=4, seed=num_out)[0] for num_out in (48, 16, 32)]
    x = torch.randn(5, 64)
    assert torch.equal(concatenate(parts)(x), torch.cat([part(x) for part in parts], dim=1))


def test_a_ggufs_q8_0_output_layer_is_taken_block_for_block():
    """The embedded model's tied token embedding (Q8_0): codes times scales give back, bit for bit, the float32
    weights transformers dequantized from the same file."""
    from gguf import GGUFReader

    from engine.config import ModelConfig
    from engine.model.model_loader import load_model
    from engine.model.model_source import resolve_model_source

    source = resolve_model_source(None)
    tensors = {t.name: t for t in GGUFReader(f"{source.path}/{source.gguf_file}").tensors}
    codes, scale, minimum = gguf_q8_blocks(tensors["token_embd.weight"])
    weight = load_model(ModelConfig(weights="float32")).model.lm_head.weight
    assert torch.equal(codes.float() * scale.repeat_interleave(32, dim=1), weight.float())
    assert not minimum.any()
    assert gguf_q8_blocks(tensors["blk.0.attn_q.weight"]) is None  # Q4_1
