"""Weight modes: each Linear replacement computes with the weights it claims, a GGUF's Q4 blocks map onto the int4
kernel exactly, and speculation is exact against plain decoding of the same weights."""
import numpy as np
import pytest
import torch

from bench.exactness import divergence_verdict
from drafters.config import SpecConfig
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model.model_source import resolve_model_source
from engine.model.weights import Int4Linear, Int8Linear, Q4Groups, gguf_q4_groups, llama_row_order
from engine.wire import SamplingParams
from scheduler.config import SchedulerConfig
from tests.engine.helpers import run_to_completion, w4a8_param
from tests.engine.test_engine import prompts


def dequantized(groups: Q4Groups) -> torch.Tensor:
    """[out, in] float32 weights the groups stand for."""
    step = groups.scales.repeat_interleave(32, dim=1)
    zero = groups.zeros.repeat_interleave(32, dim=1)
    return step * (groups.codes.float() - 8) + zero


def test_the_int4_kernel_multiplies_by_the_groups_weights():
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    groups = Q4Groups.by_range(weight)
    assert (dequantized(groups) - weight).abs().max() < (weight.abs().max() / 15)  # rounding to 16 levels
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    expected = x.bfloat16().float() @ dequantized_bf16(groups).T  # the kernel's bf16 scales and inputs
    torch.testing.assert_close(Int4Linear.from_groups(groups)(x), expected, rtol=2e-2, atol=2e-2)


def dequantized_bf16(groups: Q4Groups) -> torch.Tensor:
    """The weights with the kernel's bfloat16 scales and zero points."""
    step = groups.scales.bfloat16().float().repeat_interleave(32, dim=1)
    zero = groups.zeros.bfloat16().float().repeat_interleave(32, dim=1)
    return step * (groups.codes.float() - 8) + zero


def test_the_int8_layer_keeps_one_scale_per_output_channel():
    weight = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    layer = Int8Linear.from_weight(weight)
    restored = layer.q.float() * layer.scales.float()[:, None]
    assert (restored - weight).abs().max() <= weight.abs().amax() / 127
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), x.bfloat16().float() @ restored.T, rtol=2e-2, atol=2e-2)


def test_a_ggufs_q4_1_blocks_map_onto_the_int4_groups_exactly():
    """The embedded model's first layer: codes, scales and zeros give back, bit for bit, the float32 weights
    transformers dequantized from the same GGUF (q and k rows in transformers' order)."""
    from gguf import GGUFReader

    from engine.model.model_loader import load_model

    source = resolve_model_source(None)
    tensors = {t.name: t for t in GGUFReader(f"{source.path}/{source.gguf_file}").tensors}
    model = load_model(ModelConfig(weights="float32")).model
    config = model.config
    attention = model.model.layers[0].self_attn
    for name, module, heads in (
        ("attn_q", attention.q_proj, config.num_attention_heads),
        ("attn_k", attention.k_proj, config.num_key_value_heads),
        ("attn_v", attention.v_proj, None),
    ):
        order = llama_row_order(module.out_features, heads) if heads else None
        groups = gguf_q4_groups(tensors[f"blk.0.{name}.weight"], order)
        assert torch.equal(dequantized(groups), module.weight.float()), name
    assert gguf_q4_groups(tensors["token_embd.weight"], None) is None  # Q8_0: not a Q4 type


def test_row_order_is_a_permutation_within_each_head():
    order = llama_row_order(8, 2)
    assert sorted(order.tolist()) == list(range(8)) and order.tolist()[:4] == [0, 2, 1, 3]
    assert np.array_equal(np.sort(order[4:]), np.arange(4, 8))


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4", w4a8_param()])
def test_speculation_is_exact_against_plain_decoding_with_the_same_weights(tiny_model_dir, tmp_path, weights):
    def engine(drafter):
        return Engine(EngineConfig(
            model=ModelConfig(model=tiny_model_dir, device="cpu", weights=weights, cache_dir=str(tmp_path)),
            scheduler=SchedulerConfig(max_num_seqs=8, use_goodput_planner=False),
            spec=SpecConfig(drafter=drafter, copy_gamma=2, ngram_k=5, ngram_w=4),
        ))

    plain = engine("none")
    batch = prompts(4, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(batch)
    reference = run_to_completion(plain, batch, params)
    for drafter in ("copyspec", "ngram"):
        speculative = engine(drafter)
        if drafter == "ngram":
            assert speculative.speculation.drafter.bigram.wait(60) is not None
        outputs = run_to_completion(speculative, batch, params)
        assert sum(o.spec.num_accepted_tokens for o in outputs.values()) > 0, drafter
        for i, prompt in enumerate(batch):
            ref, out = reference[f"req-{i}"].new_token_ids, outputs[f"req-{i}"].new_token_ids
            assert divergence_verdict(plain.runner.model, prompt, ref, out) != "mismatch", (weights, drafter, i)
