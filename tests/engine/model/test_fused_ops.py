"""The lean decoder's fused operators (engine/model/csrc/fused_ops.cpp) against their torch definitions: the rotary
embedding and the residual add bit for bit, the norms and activations within float32's last bits; every row the same
bits alone as in any batch (batch invariance), and the same bits from the AVX-512, AVX2 and baseline variants."""
import pytest
import torch
import torch.nn.functional as F

from engine.model.attention_layout import key_slots
from engine.model.cpu_kernels import fused_ops_available, kernels, row_attention_available
from engine.model.decoder import rms_norm, rotate

pytestmark = pytest.mark.skipif(not fused_ops_available(), reason="the fused operators need a C++ compiler on x86-64")

EPS = 1e-6
CLOSE = {"rtol": 1e-5, "atol": 1e-6}  # a few units in the last place of float32
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def ops():
    return torch.ops.specserve


def randn(*shape, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def rows_alone(op, x: torch.Tensor, *args) -> torch.Tensor:
    """OP applied to each row of X by itself, stacked."""
    return torch.cat([op(x[i:i + 1].clone(), *args) for i in range(x.shape[0])])


ISAS = ["avx512", "avx2", "generic"]


def use_isa(name: str) -> None:
    """Run the fused operators' NAME variant from now on; skips where this CPU lacks it."""
    try:
        kernels().set_fused_ops_isa(name)
    except RuntimeError as error:
        pytest.skip(str(error))


@pytest.fixture(params=ISAS)
def isa(request):
    """Each variant this CPU runs, the default restored after."""
    default = kernels().fused_ops_isa()
    use_isa(request.param)
    yield request.param
    kernels().set_fused_ops_isa(default)


def test_every_variant_gives_the_same_bits():
    """The same float operations in the same order on AVX-512, AVX2 and baseline x86-64 (tails included)."""
    x, weight, gate_up = randn(3, 577, seed=13), randn(577, seed=14), randn(3, 2 * 2051, seed=15, scale=4.0)
    qkv, (cos, sin) = randn(2, 4 * 256, seed=16), rotary(2, 256)
    default, outputs = kernels().fused_ops_isa(), {}
    try:
        for name in ISAS:
            try:
                kernels().set_fused_ops_isa(name)
            except RuntimeError:  # not on this CPU
                continue
            keys, values = torch.zeros(4, 1, 256), torch.zeros(4, 1, 256)
            outputs[name] = [
                ops().rms_norm(x, weight, EPS), ops().gated_activation(gate_up, "silu"),
                ops().gated_activation(gate_up, "gelu_pytorch_tanh"), ops().add_rms_norm(x.clone(), x, weight, EPS,
                                                                                          weight, EPS),
                ops().rope_write(qkv, cos, sin, 2, 1, weight[:256], weight[256:512], EPS, keys, values,
                                 torch.tensor([1, 3])), keys, ops().sample_rows(gate_up, 1.3, [0.2, 0.7, 1.0]),
                ops().argmax_rows(gate_up),
            ]
    finally:
        kernels().set_fused_ops_isa(default)
    first, *others = outputs.values()
    for name, got in zip(list(outputs)[1:], others):
        assert all(torch.equal(a, b) for a, b in zip(first, got)), name


def argmax_rows_cases() -> torch.Tensor:
    """Rows whose argmax torch.argmax decides by its rules: ties (the first index), NaN (the first NaN), infinities,
    a row of -inf, signed zeros, the largest in the tail past the last whole vector of 16."""
    n = 49_157  # 3,072 vectors of 16 and a tail of 5
    rows = randn(12, n, seed=21, scale=3.0).round()  # rounded: many ties of the largest
    rows[1, [7, 9_000, 49_000]] = 100.0
    rows[2, [40, 30_000]] = float("nan")
    rows[3, 17] = float("inf")
    rows[4] = float("-inf")
    rows[5] = 0.0
    rows[5, :8] = -0.0
    rows[6, n - 2] = 1e9
    rows[7, [n - 1, 3]] = 1e9  # a tie between the tail and the first vector
    rows[8, n - 3] = float("nan")
    rows[9, [33, 1_000]] = float("inf")
    rows[10, 5] = float("-inf")
    return rows


@pytest.mark.parametrize("n", [49_157, 49_152, 16, 15, 1])
def test_argmax_rows_is_torchs_argmax(isa, n):
    rows = argmax_rows_cases()[:, :n].contiguous()
    assert torch.equal(ops().argmax_rows(rows), rows.argmax(dim=-1))
    strided = argmax_rows_cases()[:, :n]  # rows that lie apart in memory
    assert torch.equal(ops().argmax_rows(strided), strided.argmax(dim=-1))


@pytest.mark.parametrize("n", [576, 577, 40])
def test_rms_norm_is_torchs_within_a_rounding_and_each_row_alone(isa, n):
    x, weight = randn(9, n, scale=3.0), randn(n, seed=1)
    got = ops().rms_norm(x, weight, EPS)
    torch.testing.assert_close(got, F.rms_norm(x, (n,), weight, EPS), **CLOSE)
    assert torch.equal(rows_alone(ops().rms_norm, x, weight, EPS), got)
    strided = torch.cat([x, x], dim=1)[:, :n]  # rows apart in memory
    assert torch.equal(ops().rms_norm(strided, weight, EPS), got)


@pytest.mark.parametrize("gemma_norms", [False, True])
def test_add_rms_norm_adds_in_place_and_norms_the_sum(isa, gemma_norms):
    """hidden + delta exactly as torch adds (Llama); hidden + rms_norm(delta) by a second weight (Gemma's norms after
    attention and after the MLP); -> the sum's norm."""
    n = 640
    hidden, delta, weight = randn(5, n, seed=2), randn(5, n, seed=3, scale=2.0), randn(n, seed=4)
    delta_weight = randn(n, seed=5) if gemma_norms else None
    expected_sum = hidden + (F.rms_norm(delta, (n,), delta_weight, EPS) if gemma_norms else delta)
    updated = hidden.clone()
    normed = ops().add_rms_norm(updated, delta, weight, EPS, delta_weight, EPS)
    if gemma_norms:
        torch.testing.assert_close(updated, expected_sum, **CLOSE)
    else:
        assert torch.equal(updated, expected_sum)
    torch.testing.assert_close(normed, F.rms_norm(updated, (n,), weight, EPS), **CLOSE)
    assert torch.equal(normed, ops().rms_norm(updated, weight, EPS))
    for i in range(5):  # each row alone: the same sum and norm
        alone = hidden[i:i + 1].clone()
        assert torch.equal(ops().add_rms_norm(alone, delta[i:i + 1], weight, EPS, delta_weight, EPS), normed[i:i + 1])
        assert torch.equal(alone[0], updated[i])


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("n", [1536, 2048, 37])
def test_gated_activation_is_torchs_within_a_rounding_and_each_row_alone(isa, activation, n):
    gate_up = randn(6, 2 * n, seed=6, scale=4.0)
    gate_up[0, :8] = torch.tensor([-100.0, -90.0, -20.0, 0.0, 20.0, 90.0, 100.0, -1e-8])  # exp's clamped range
    gate, up = gate_up.chunk(2, dim=-1)
    got = ops().gated_activation(gate_up, activation)
    torch.testing.assert_close(got, ACTIVATIONS[activation](gate) * up, rtol=1e-5, atol=1e-5)
    assert torch.equal(rows_alone(ops().gated_activation, gate_up, activation), got)


def rotary(num_tokens: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] as transformers' default rotary embedding makes them."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = (torch.arange(num_tokens) + 5).float()[:, None] * inv_freq[None]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("head_dim", [64, 256, 40])
@pytest.mark.parametrize("gemma_norms", [False, True])
def test_rope_write_rotates_queries_and_keys_and_writes_the_pool(isa, head_dim, gemma_norms):
    """Queries and keys rotated as transformers rotates them (bit for bit without per-head norms), the keys and the
    values written at the tokens' slots of one layer and nowhere else; each token alone gives the same bits."""
    heads, kv_heads, tokens, slots = 6, 2, 5, torch.tensor([9, 3, 17, 4, 30])
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=7)
    cos, sin = rotary(tokens, head_dim)
    q_weight, k_weight = (randn(head_dim, seed=8), randn(head_dim, seed=9)) if gemma_norms else (None, None)
    keys, values = torch.zeros(2, 32, kv_heads, head_dim), torch.zeros(2, 32, kv_heads, head_dim)
    query = ops().rope_write(qkv, cos, sin, heads, kv_heads, q_weight, k_weight, EPS, keys[1], values[1], slots)
    q, k, v = qkv.view(tokens, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    if gemma_norms:
        q, k = rms_norm(q, q_weight, EPS, gemma=True), rms_norm(k, k_weight, EPS, gemma=True)
    expected_q, expected_k = rotate(q, cos[:, None], sin[:, None]), rotate(k, cos[:, None], sin[:, None])
    if gemma_norms:
        torch.testing.assert_close(query, expected_q, **CLOSE)
        torch.testing.assert_close(keys[1, slots], expected_k, **CLOSE)
    else:
        assert torch.equal(query, expected_q) and torch.equal(keys[1, slots], expected_k)
    assert torch.equal(values[1, slots], v)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not keys[0].any() and not values[0].any()
    assert not keys[1, untouched].any() and not values[1, untouched].any()
    for t in range(tokens):
        alone_keys, alone_values = torch.zeros(1, kv_heads, head_dim), torch.zeros(1, kv_heads, head_dim)
        alone = ops().rope_write(qkv[t:t + 1], cos[t:t + 1], sin[t:t + 1], heads, kv_heads, q_weight, k_weight, EPS,
                                 alone_keys, alone_values, torch.tensor([0]))
        assert torch.equal(alone[0], query[t]) and torch.equal(alone_keys[0], keys[1, slots[t]])


@pytest.mark.skipif(not row_attention_available(), reason="row_attention needs AVX-512F or AVX2 with FMA")
@pytest.mark.parametrize("num_queries", [1, 3])
@pytest.mark.parametrize("blocks", ["consecutive", "scattered"])
def test_span_attention_reads_a_sequences_keys_where_they_lie_in_the_pool(num_queries, blocks):
    """A sequence's queries over its keys at their pool slots, in consecutive slots or in blocks scattered over the
    pool (the padding keys' slots anything): the bits of row_attention over a copy of those keys in order, the query
    heads folded into rows as paged_attention folds them."""
    heads, kv_heads, head_dim, context_len, num_keys, block_size = 9, 3, 64, 300, 384, 16
    keys, values = randn(1024, kv_heads, head_dim, seed=10), randn(1024, kv_heads, head_dim, seed=11)
    query = randn(num_queries, heads, head_dim, seed=12)
    group = heads // kv_heads
    mask = torch.zeros(1, 1, group * num_queries, num_keys, dtype=torch.bool)
    mask[..., :context_len] = True
    table = list(range(1, 25)) if blocks == "consecutive" else torch.randperm(
        64, generator=torch.Generator().manual_seed(3))[:24].tolist()
    slots = key_slots(table, context_len, num_keys, block_size)
    got = ops().span_attention(query, keys, values, slots, mask, 0.125)
    q = query.transpose(0, 1).reshape(1, kv_heads, group * num_queries, head_dim)
    k, v = (pool[slots].transpose(0, 1)[None] for pool in (keys, values))  # copies, in key order
    expected = ops().row_attention(q, k, v, mask, 0.125, group).reshape(1, heads, num_queries, head_dim)
    assert got.is_contiguous()
    assert torch.equal(got, expected[0].transpose(0, 1))
    assert torch.equal(slots[:context_len], torch.tensor([b * block_size + i for b in table for i in range(16)])[:300])


@pytest.mark.skipif(not row_attention_available(), reason="row_attention needs AVX-512F or AVX2 with FMA")
def test_a_key_slot_outside_the_pool_is_refused():
    keys = randn(64, 1, 64, seed=1)
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="key_rows must index"):
        ops().span_attention(randn(1, 1, 64, seed=2), keys, keys, torch.arange(60, 76), mask, 0.125)


@pytest.mark.skipif(not row_attention_available(), reason="row_attention needs AVX-512F or AVX2 with FMA")
def test_spans_attention_writes_each_spans_rows_as_span_attention_computes_them():
    """Two sequences read in place, their rows of the packed output written in one call; a row of neither left as
    it was."""
    heads, kv_heads, head_dim = 4, 2, 64
    keys, values = randn(1024, kv_heads, head_dim, seed=13), randn(1024, kv_heads, head_dim, seed=14)
    query = randn(6, heads, head_dim, seed=15)
    spans = [(0, 1, torch.arange(16, 16 + 384)), (1, 4, torch.arange(1023, 1023 - 448, -1))]  # start, queries, slots
    masks = []
    for _, num_queries, slots in spans:
        mask = torch.ones(1, 1, 2 * num_queries, len(slots), dtype=torch.bool)
        mask[..., len(slots) - 30:] = False
        masks.append(mask)
    out = torch.full_like(query, float("nan"))
    starts, lengths, slots = (list(column) for column in zip(*spans))
    ops().spans_attention(query, keys, values, starts, lengths, slots, masks, 0.125, out)
    for (start, num_queries, key_slots_of_span), mask in zip(spans, masks):
        expected = ops().span_attention(query[start:start + num_queries], keys, values, key_slots_of_span, mask, 0.125)
        assert torch.equal(out[start:start + num_queries], expected)
    assert torch.isnan(out[5]).all()


@pytest.mark.skipif(not row_attention_available(), reason="row_attention needs AVX-512F or AVX2 with FMA")
def test_decoding_spans_read_and_written_in_place_give_span_attentions_bits():
    """Spans of one query (a decoding step's) are read from the packed query and written to the packed output in
    place, beside a span of several queries in the same call: each row the bits span_attention gives it alone, the
    embedded model's 9 query heads over 3 KV heads, contexts of any length, keys where their blocks lie apart."""
    heads, kv_heads, head_dim = 9, 3, 64
    keys, values = randn(2048, kv_heads, head_dim, seed=16), randn(2048, kv_heads, head_dim, seed=17)
    generator = torch.Generator().manual_seed(4)
    lengths = [1, 1, 3, 1, 1, 1]
    query = randn(sum(lengths), heads, head_dim, seed=18)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    slots, masks = [], []
    for num_queries, context in zip(lengths, [1, 17, 40, 300, 513, 64]):
        num_keys = -(-context // 16) * 16
        slots.append(torch.randperm(2048, generator=generator)[:num_keys])
        mask = torch.zeros(1, 1, num_queries, num_keys, dtype=torch.bool)
        for i in range(num_queries):
            mask[..., i, :context - num_queries + 1 + i] = True
        # a decoding span's mask as the engine lays it out: one row expanded over the query heads (strides 0)
        masks.append(mask if num_queries > 1 else mask.expand(1, 1, heads // kv_heads, num_keys))
    out = torch.full_like(query, float("nan"))
    ops().spans_attention(query, keys, values, starts, lengths, slots, masks, 0.125, out)
    for start, num_queries, key_slots_of_span, mask in zip(starts, lengths, slots, masks):
        expected = ops().span_attention(query[start:start + num_queries], keys, values, key_slots_of_span, mask, 0.125)
        assert torch.equal(out[start:start + num_queries], expected)
    bad = [torch.arange(2040, 2056)] + slots[1:]  # a decoding span's slot past the pool
    with pytest.raises(RuntimeError, match="key_rows must index"):
        ops().spans_attention(query, keys, values, starts, lengths, bad, [torch.ones(1, 1, 1, 16, dtype=torch.bool)]
                              + masks[1:], 0.125, out)
