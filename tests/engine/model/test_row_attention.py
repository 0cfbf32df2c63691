"""The CPU row attention kernel: softmax attention over the keys each row may see, and a row's output the same bits
whatever else is in the call, on each of its variants (AVX-512F, AVX2), which give the same bits."""
import pytest
import torch

from engine.model.cpu_kernels import kernels, row_attention_available

pytestmark = pytest.mark.skipif(not row_attention_available(),
                                reason="the row attention kernel needs AVX-512F or AVX2 with FMA and a C++ compiler")
VARIANTS = ["avx512", "avx2"]


def has_avx512() -> bool:
    return kernels().has_avx512()


@pytest.fixture(autouse=True, params=VARIANTS)
def variant(request):
    """Each test on each variant this CPU runs, the process's own restored after it."""
    module = kernels()
    if request.param == "avx512" and not has_avx512():
        pytest.skip("this CPU has no AVX-512F")
    before = module.row_attention_isa()
    module.set_row_attention_isa(request.param)
    yield request.param
    module.set_row_attention_isa(before)


def attend(q, k, v, mask, scale=0.125, heads_per_kv_head=1):
    return torch.ops.specserve.row_attention(q, k, v, mask, scale, heads_per_kv_head)


def pool_views(num_keys: int, kv_heads: int, head_dim: int, seed: int):
    """Keys and values as the engine passes them: [1, kv_heads, L, d] views of a [slots, kv_heads, d] pool."""
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(num_keys + 100, kv_heads, head_dim, generator=generator) for _ in range(2))
    return keys[50:50 + num_keys].transpose(0, 1)[None], values[50:50 + num_keys].transpose(0, 1)[None]


@pytest.mark.parametrize("head_dim", [64, 8, 40])  # whole vectors, less than one, and a partial last one
def test_it_computes_masked_softmax_attention(head_dim):
    k, v = pool_views(300, kv_heads=3, head_dim=head_dim, seed=head_dim)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, 7, head_dim, generator=generator)
    mask = torch.rand(1, 1, 7, 300, generator=generator) > 0.3
    scores = (q.double() @ k.double().transpose(2, 3) * 0.125).masked_fill(~mask, float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ v.double()
    torch.testing.assert_close(attend(q, k, v, mask).double(), expected, rtol=1e-5, atol=1e-6)


def test_a_rows_output_ignores_the_other_rows_and_the_keys_it_may_not_see():
    """Alone, among other rows, with more masked keys after its own and with masked keys between them: the same bits."""
    k, v = pool_views(364, kv_heads=2, head_dim=64, seed=2)
    q = torch.randn(1, 2, 5, 64, generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(1, 1, 5, 364, dtype=torch.bool)
    mask[..., :300] = torch.rand(1, 1, 5, 300, generator=torch.Generator().manual_seed(4)) > 0.2
    whole = attend(q, k[:, :, :300], v[:, :, :300], mask[..., :300])
    assert torch.equal(attend(q, k, v, mask), whole)  # 64 more keys, all masked
    for row in range(5):
        assert torch.equal(attend(q[:, :, row:row + 1], k[:, :, :300], v[:, :, :300], mask[:, :, row:row + 1, :300]),
                           whole[:, :, row:row + 1])
    spread = torch.zeros(1, 1, 1, 364, dtype=torch.bool)  # row 0's keys with masked keys interleaved
    seen = mask[0, 0, 0, :300].nonzero().flatten()
    moved_k, moved_v = torch.zeros_like(k), torch.zeros_like(v)
    moved_k[:, :, seen + 1], moved_v[:, :, seen + 1] = k[:, :, seen], v[:, :, seen]
    spread[..., seen + 1] = True
    assert torch.equal(attend(q[:, :, :1], moved_k, moved_v, spread), whole[:, :, :1])


@pytest.mark.parametrize("head_dim,heads_per_kv_head,kv_heads,num_queries,threads",
                         [(64, 3, 2, 5, 2), (128, 8, 2, 5, 2), (40, 3, 2, 5, 2), (256, 4, 1, 1, 2), (256, 4, 1, 1, 4)])
def test_the_heads_of_a_query_computed_together_get_the_bits_each_gets_alone(
    head_dim, heads_per_kv_head, kv_heads, num_queries, threads
):
    """The G query heads of a KV head at one query share a mask row and are computed together (up to 4 at a time,
    sharing key and value loads; split over the threads where there are fewer queries than threads, as when
    decoding with one KV head); each gets exactly what it gets computed as a row of its own."""
    k, v = pool_views(300, kv_heads=kv_heads, head_dim=head_dim, seed=5)
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(1, kv_heads, heads_per_kv_head * num_queries, head_dim, generator=generator)
    mask = torch.rand(1, 1, num_queries, 300, generator=generator) > 0.3
    tiled = mask.repeat(1, 1, heads_per_kv_head, 1)  # row g * Q + i: head g at query i
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = attend(q, k, v, tiled)
        assert torch.equal(attend(q, k, v, tiled, heads_per_kv_head=heads_per_kv_head), alone)
    finally:
        torch.set_num_threads(saved_threads)
    assert torch.equal(attend(q, k, v, mask, heads_per_kv_head=heads_per_kv_head), alone)  # one mask row per query


@pytest.mark.parametrize("head_dim", [256, 64, 40])
def test_the_avx512_and_avx2_variants_give_the_same_bits(head_dim, variant):
    """A tree-masked call with a partial last key block and, at 40, a partial last channel vector: both variants."""
    if not has_avx512():
        pytest.skip("this CPU has no AVX-512F: only the AVX2 variant runs here")
    module = kernels()
    k, v = pool_views(333, kv_heads=1, head_dim=head_dim, seed=7)
    generator = torch.Generator().manual_seed(8)
    q = torch.randn(1, 1, 4 * 3, head_dim, generator=generator) * 3
    mask = torch.rand(1, 1, 3, 333, generator=generator) > 0.4
    outputs = []
    for isa in VARIANTS:
        module.set_row_attention_isa(isa)
        outputs.append(attend(q, k, v, mask, heads_per_kv_head=4))
    module.set_row_attention_isa(variant)
    assert torch.equal(*outputs)
