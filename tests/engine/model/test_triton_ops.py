"""The GPU's fused operators in Triton (on a CPU through Triton's interpreter) against the unfused torch operators
they replace, in float32 and bfloat16, and a whole lean forward through them against the unfused one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engine.model.decoder import rms_norm, rotate
from engine.model.forward import ForwardBatch, chain_item
from engine.model.packed_runner import PackedModelRunner
from engine.model.paged_attention import PagedKVPool, triton_available
from scheduler.kv_blocks import KVBlockManager

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # on a CPU: Triton's interpreter
pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="needs the triton package (a test dependency)")
# float32: rounding only; bfloat16: one unit in the last place (8 bits of mantissa) where the interpreter or a GPU
# rounds a cast differently from torch's CPU operators
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.fixture(scope="module")
def ops():
    from engine.model import triton_ops  # after the conftest chose the interpreter

    return triton_ops


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_scale_like_llama_and_gemma(ops, dtype):
    x, llama_weight, gemma_weight = rand(3, 40, dtype=dtype), rand(40, dtype=dtype, seed=1), rand(40, seed=2)
    torch.testing.assert_close(ops.rms_norm(x, llama_weight, 1e-6), rms_norm(x, llama_weight, 1e-6), **TOLERANCE[dtype])
    torch.testing.assert_close(ops.rms_norm(x, gemma_weight, 1e-6), rms_norm(x, gemma_weight, 1e-6, gemma=True),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta_normed", [False, True])
def test_add_rms_norm_updates_the_residual_in_place_and_norms_it(ops, dtype, delta_normed):
    hidden, delta, weight = rand(3, 40, dtype=dtype), rand(3, 40, dtype=dtype, seed=1), rand(40, dtype=dtype, seed=2)
    delta_weight = rand(40, seed=3) if delta_normed else None
    expected_hidden = hidden + (rms_norm(delta, delta_weight, 1e-5, gemma=True) if delta_normed else delta)
    fused_hidden = hidden.clone()
    out = ops.add_rms_norm(fused_hidden, delta, weight, 1e-6, delta_weight, 1e-5)
    torch.testing.assert_close(fused_hidden, expected_hidden, **TOLERANCE[dtype])
    torch.testing.assert_close(out, rms_norm(expected_hidden, weight, 1e-6), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation(ops, dtype, activation):
    gate_up = rand(3, 2 * 1500, dtype=dtype)  # more than one block of columns
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    torch.testing.assert_close(ops.gated_activation(gate_up, activation), act * up, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_rotates_queries_and_keys_and_writes_the_pool(ops, dtype, qk_norm):
    heads, kv_heads, head_dim, tokens = 4, 2, 24, 3
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    cos, sin = rand(tokens, 1, head_dim, dtype=dtype, seed=1), rand(tokens, 1, head_dim, dtype=dtype, seed=2)
    q_weight, k_weight = (rand(head_dim, seed=3), rand(head_dim, seed=4)) if qk_norm else (None, None)
    keys, values = (torch.full((10, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    slots = torch.tensor([7, 2, 5], device=DEVICE)
    query = ops.rope_write(qkv, cos, sin, heads, kv_heads, q_weight, k_weight, 1e-6, keys, values, slots)
    q, k, v = qkv.view(tokens, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    if qk_norm:
        q, k = rms_norm(q, q_weight, 1e-6, gemma=True), rms_norm(k, k_weight, 1e-6, gemma=True)
    torch.testing.assert_close(query, rotate(q, cos, sin), **TOLERANCE[dtype])
    torch.testing.assert_close(keys[slots], rotate(k, cos, sin), **TOLERANCE[dtype])
    torch.testing.assert_close(values[slots], v, rtol=0, atol=0)
    others = [s for s in range(10) if s not in (7, 2, 5)]
    assert keys[others].isnan().all() and values[others].isnan().all()  # no other slot written


def test_a_lean_forward_through_the_triton_operators_equals_the_unfused_one(ops, tiny_model_dir):
    logits = {}
    for fused in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(DEVICE).eval()
        config = model.config
        pool = PagedKVPool(config.num_hidden_layers, 64 * 4, config.num_key_value_heads,
                           config.hidden_size // config.num_attention_heads, torch.float32, DEVICE)
        runner = PackedModelRunner(model, DEVICE, pool, 4, "triton")
        runner.decoder.ops, runner.decoder.fuses = (ops, True) if fused else (None, False)
        blocks = KVBlockManager(num_blocks=64, block_size=4)
        a, b = [1, 5, 9, 13, 2, 7], [1, 30, 31]
        logits[fused] = runner.execute(ForwardBatch([chain_item(a, 0, blocks.grow("a", 6), 4, 6),
                                                     chain_item(b, 0, blocks.grow("b", 3), 4)])).logits
        logits[fused] += runner.execute(ForwardBatch([chain_item([4, 8], 6, blocks.grow("a", 8), 4, 2),
                                                      chain_item([11], 3, blocks.grow("b", 4), 4)])).logits
    for unfused, fused in zip(logits[False], logits[True]):
        torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-4)
