"""The block_linear kernel: integer dot products of 8-bit activations with a GGUF's weight blocks, on AMX,
AVX512-VNNI and AVX2, equal bit for bit to a reference that reproduces its float32 steps, the same for a row whatever
rows it is computed with, and the same on every instruction set. AMX multiplies rows 16 at a time from 16 (signed codes)
or 32 rows (unsigned) and leaves the rest to VNNI: the tests take more than 32 rows so that both run."""
import pytest
import torch

from engine.model.block_linear import BlockLinear, available, concatenate
from engine.model.blocks import BlockWeights
from engine.model.cpu_kernels import ISAS, isa_supported

pytestmark = pytest.mark.skipif(not any(isa_supported(isa) for isa in ISAS),
                                reason="block_linear needs AVX2 or AVX512-VNNI and a C++ compiler for its kernel")

FORMS = ["unsigned4", "unsigned8", "signed32", "signed16", "narrow32", "narrow16"]  # narrow: signed, -32..31
ISA_PARAMS = [pytest.param(isa, marks=pytest.mark.skipif(not isa_supported(isa), reason=f"this CPU lacks {isa}"))
              for isa in ISAS]


def random_weights(form: str, num_out: int, num_in: int, seed: int, halves: bool = False) -> BlockWeights:
    """Weights of FORM with codes over their whole range (signed: -128 included; narrow: -32..31), in assorted
    integer dtypes; with HALVES, scales and minimums that are exactly float16 numbers (as a GGUF's Q4_1 or Q8_0
    stores them), subnormal ones included."""
    generator = torch.Generator().manual_seed(seed)

    def rounded(t: torch.Tensor) -> torch.Tensor:
        if halves:
            t = t.half().float()
            t.view(-1)[:3] = torch.tensor([2.0**-24, -(2.0**-20), 6e-5]).half().float()  # subnormal halves
        return t

    if form.startswith("unsigned"):
        bits, high, dtype = (4, 16, torch.uint8) if form == "unsigned4" else (8, 32, torch.int64)
        codes = torch.randint(0, high, (num_out, num_in), generator=generator, dtype=dtype)
        scales = rounded(torch.rand(num_out, num_in // 32, generator=generator) / 10)
        mins = rounded(-torch.rand(num_out, num_in // 32, generator=generator))
        return BlockWeights(codes, scales, mins, bits=bits)
    sub, dtype = (16, torch.int16) if form.endswith("16") else (32, torch.int8)
    low = -32 if form.startswith("narrow") else -128
    codes = torch.randint(low, -low, (num_out, num_in), generator=generator, dtype=dtype)
    scales = rounded(torch.rand(num_out, num_in // sub, generator=generator) / 100)
    return BlockWeights(codes, scales, None, bits=8, sub=sub)


def activations(rows: int, num_in: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, num_in, generator=torch.Generator().manual_seed(seed))
    x[min(2, rows - 1), :32] = 0  # a block of zeros: scale 0, no division by it
    return x


def reference(x: torch.Tensor, weights: BlockWeights) -> torch.Tensor:
    """The kernel's arithmetic: activation codes in float32 as it rounds them, the integer dots exactly (float64
    holds them), then its float32 steps per block in its order, each product and sum rounded to float32."""
    rows, num_in = x.shape
    blocks = num_in // 32
    xb = x.float().reshape(rows, blocks, 32)
    d = xb.abs().amax(-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inverse[..., None])  # half to even, as nearbyint
    sums = q.sum(-1)  # exact integers
    sub = weights.sub
    codes = weights.codes.double().reshape(weights.shape[0], num_in // sub, sub)
    dots = torch.einsum("mbk,nbk->mnb", q.double().reshape(rows, num_in // sub, sub), codes).float()  # exact
    scales = weights.scales.float()
    acc = torch.zeros(rows, weights.shape[0])
    for b in range(blocks):
        if sub == 16:
            t = dots[:, :, 2 * b] * scales[:, 2 * b]
            t = t + dots[:, :, 2 * b + 1] * scales[:, 2 * b + 1]
        else:
            t = dots[:, :, b] * scales[:, b]
        if not weights.signed:
            t = t + weights.mins.float()[:, b] * sums[:, b, None]
        acc = acc + t * d[:, b, None]
    return acc


@pytest.mark.parametrize("halves", [False, True], ids=["float32-scales", "float16-scales"])
@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(40, 64), (96, 96), (640, 2048)])  # 40: a last tile padded
def test_the_kernel_computes_the_arithmetic_it_claims_bit_for_bit(form, isa, shape, halves):
    """Scales that are exactly halves are kept as float16 (half the bytes), others as float32: the same arithmetic."""
    weights = random_weights(form, *shape, seed=sum(shape) + FORMS.index(form), halves=halves)
    layer = BlockLinear.from_blocks(weights, isa=isa)
    assert layer.scales.dtype == (torch.float16 if halves else torch.float32)
    assert layer.mins is None or layer.mins.dtype == layer.scales.dtype
    x = activations(37, shape[1], seed=1)
    out = layer(x)
    assert out.shape == (37, shape[0]) and out.dtype == torch.float32
    assert torch.equal(out, reference(x, weights))


@pytest.mark.parametrize("halves", [False, True], ids=["float32-scales", "float16-scales"])
@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("form", FORMS)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(form, isa, halves):
    """Rows alone, in groups of 4 and 16 (the kernels' row blocking) and in partial groups give bit-identical
    outputs."""
    layer = BlockLinear.from_blocks(random_weights(form, 128, 192, seed=3, halves=halves), isa=isa)
    x = activations(37, 192, seed=2)
    whole = layer(x)
    assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(37)]), whole)
    for start, end in ((0, 4), (1, 4), (3, 10), (5, 11), (4, 8), (0, 16), (3, 19), (16, 37), (0, 32), (5, 37)):
        assert torch.equal(layer(x[start:end]), whole[start:end])


@pytest.mark.parametrize("halves", [False, True], ids=["float32-scales", "float16-scales"])
@pytest.mark.parametrize("form", FORMS)
def test_every_instruction_set_gives_the_same_bits(form, halves):
    supported = [isa for isa in ISAS if isa_supported(isa)]
    if len(supported) < 2:
        pytest.skip(f"this CPU runs one of {', '.join(ISAS)} only: nothing to compare")
    weights = random_weights(form, 200, 320, seed=5, halves=halves)
    x = activations(41, 320, seed=4)
    first, *others = (BlockLinear.from_blocks(weights, isa=isa)(x) for isa in supported)
    for other in others:
        assert torch.equal(first, other)


@pytest.mark.parametrize("form", FORMS)
def test_fused_layers_give_their_parts_outputs(form):
    """Parts whose scales are halves beside one whose are not: the fused layer keeps them all as float32."""
    parts = [BlockLinear.from_blocks(random_weights(form, num_out, 64, seed=num_out, halves=num_out != 16))
             for num_out in (48, 16, 32)]
    assert [part.scales.dtype for part in parts] == [torch.float16, torch.float32, torch.float16]
    fused = concatenate(parts)
    assert fused.scales.dtype == torch.float32 and concatenate(parts[::2]).scales.dtype == torch.float16
    x = activations(5, 64, seed=6)
    assert fused.out_features == 96 and fused.in_features == 64
    assert torch.equal(fused(x), torch.cat([part(x) for part in parts], dim=1))


def test_only_whole_tiles_of_one_form_fuse():
    def layer(form: str, num_out: int) -> BlockLinear:
        return BlockLinear.from_blocks(random_weights(form, num_out, 64, seed=1))

    with pytest.raises(ValueError, match="whole tiles"):
        concatenate([layer("unsigned4", 40), layer("unsigned4", 32)])
    with pytest.raises(ValueError, match="same form"):
        concatenate([layer("signed32", 32), layer("unsigned4", 32)])


@pytest.mark.parametrize("form", FORMS)
def test_the_kernel_multiplies_by_the_dequantized_weights(form):
    """Sanity: the float matmul with dequantize()'s weights, up to the activations' rounding to 8 bits."""
    weights = random_weights(form, 96, 256, seed=7)
    x = activations(6, 256, seed=8).to(torch.bfloat16)
    out = BlockLinear.from_blocks(weights)(x)
    assert out.dtype == torch.bfloat16
    expected = x.float() @ weights.dequantize().T
    torch.testing.assert_close(out.float(), expected, rtol=0.02, atol=0.02 * expected.abs().max().item())
    assert BlockLinear.from_blocks(weights)(x.float().reshape(2, 3, 256)).shape == (2, 3, 96)


def test_weights_the_kernel_cannot_multiply_exactly_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 32"):
        BlockLinear.from_blocks(BlockWeights(torch.zeros(16, 40, dtype=torch.uint8), torch.ones(16, 1),
                                             torch.zeros(16, 1), bits=4))
    with pytest.raises(ValueError, match="0..15"):
        BlockLinear.from_blocks(BlockWeights(torch.full((16, 32), 16), torch.ones(16, 1), torch.zeros(16, 1), bits=4))
    with pytest.raises(ValueError, match="no kernel"):
        BlockLinear.from_blocks(BlockWeights(torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, 1), None, bits=4))


def test_the_isa_cap_is_honoured(monkeypatch):
    from engine.model.cpu_kernels import cpu_isa, row_attention_available

    monkeypatch.delenv("SPECSERVE_CPU_ISA", raising=False)
    assert cpu_isa() == next((isa for isa in ISAS if isa_supported(isa)), None)  # the best this CPU has
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "avx512vnni")
    assert cpu_isa() == ("avx512vnni" if isa_supported("avx512vnni") else "avx2" if isa_supported("avx2") else None)
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "avx2")
    assert cpu_isa() == ("avx2" if isa_supported("avx2") else None)
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "none")
    assert cpu_isa() is None and not available() and not row_attention_available()


def test_narrow_signed_codes_take_the_narrow_kernel_and_fuse_with_full_ones():
    """Q5_0's and Q6_K's codes (-32..31) are told to the kernel as bits 6; fused beside full-range codes (a Q8_0
    value beside a Q5_0 key) the layer is multiplied as full-range, with the same outputs."""
    narrow, full = random_weights("narrow32", 32, 64, seed=7), random_weights("signed32", 16, 64, seed=8)
    layers = [BlockLinear.from_blocks(w) for w in (narrow, full)]
    assert [layer.bits for layer in layers] == [6, 8]
    fused = concatenate(layers)
    x = activations(5, 64, seed=9)
    assert fused.bits == 8 and torch.equal(fused(x), torch.cat([layer(x) for layer in layers], dim=1))


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("form", ["narrow32", "narrow16", "signed32", "unsigned8"])
def test_the_largest_products_do_not_saturate(form, isa):
    """Codes at the ends of their range against activation codes of +-127 everywhere: the int16 sums the AVX2 variant
    forms before widening are at their largest (narrow: two groups of 63 * 127 pairs, 32,004)."""
    weights = random_weights(form, 32, 64, seed=10)
    high = 31 if form.startswith(("narrow", "unsigned")) else 127
    low = 0 if form.startswith("unsigned") else (-32 if form.startswith("narrow") else -128)
    weights.codes = torch.where(torch.arange(32)[:, None] % 2 == 0, high, low).expand(32, 64).to(weights.codes.dtype)
    x = torch.ones(3, 64)
    x[1] = -1
    x[2, ::2] = -1
    assert torch.equal(BlockLinear.from_blocks(weights, isa=isa)(x), reference(x, weights))
