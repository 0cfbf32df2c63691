"""Weight modes: each Linear replacement computes with the weights it claims, a GGUF's blocks map onto the kernels
exactly, and speculation is exact against plain decoding of the same weights."""
import numpy as np
import pytest
import torch

from bench.exactness import divergence_verdict
from drafters.config import SpecConfig
from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model.blocks import BlockWeights
from engine.model.gguf_file import gguf_tensors
from engine.model.model_source import resolve_model_source
from engine.model.weights import Int4Linear, Int8Linear, file_blocks, llama_row_order
from engine.wire import SamplingParams
from scheduler.config import SchedulerConfig
from tests.engine.helpers import gguf_param, run_to_completion
from tests.engine.test_engine import prompts


def int4_weights(blocks: BlockWeights, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in] float32 weights the int4 kernel multiplies by: scale (q - 8) + zero, scales and zeros in DTYPE."""
    scales = blocks.scales.to(dtype).float()
    zeros = (blocks.mins + 8 * blocks.scales).to(dtype).float()
    return scales.repeat_interleave(32, dim=1) * (blocks.codes.float() - 8) + zeros.repeat_interleave(32, dim=1)


def test_the_int4_kernel_multiplies_by_the_blocks_weights():
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    blocks = BlockWeights.by_range(weight)
    assert (int4_weights(blocks) - weight).abs().max() < (weight.abs().max() / 15)  # rounding to 16 levels
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    expected = x.bfloat16().float() @ int4_weights(blocks, torch.bfloat16).T  # the kernel's bf16 scales and inputs
    torch.testing.assert_close(Int4Linear.from_blocks(blocks)(x), expected, rtol=2e-2, atol=2e-2)


def test_the_int8_layer_keeps_one_scale_per_output_channel():
    weight = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    layer = Int8Linear.from_weight(weight)
    restored = layer.q.float() * layer.scales.float()[:, None]
    assert (restored - weight).abs().max() <= weight.abs().amax() / 127
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), x.bfloat16().float() @ restored.T, rtol=2e-2, atol=2e-2)


def test_a_ggufs_blocks_are_laid_out_as_the_loaded_weights():
    """The embedded model's first layer and output layer: the GGUF's blocks, in the row order that gives back, bit
    for bit, the float32 weights transformers dequantized from the same file (q and k rows permuted for a
    Llama-architecture GGUF); the 4-bit ones map onto the int4 kernel's codes exactly."""
    from engine.model.model_loader import load_model

    source = resolve_model_source(None)
    tensors = gguf_tensors(source.gguf_path)
    model = load_model(ModelConfig(weights="float32")).model
    config = model.config
    attention = model.model.layers[0].self_attn
    for name, module, heads in (
        ("attn_q", attention.q_proj, config.num_attention_heads),
        ("attn_k", attention.k_proj, config.num_key_value_heads),
        ("attn_v", attention.v_proj, None),
    ):
        blocks = file_blocks(module.weight, tensors[f"blk.0.{name}.weight"], heads)
        assert blocks is not None and torch.equal(int4_weights(blocks), module.weight.float()), name
        assert torch.equal(Int4Linear.from_blocks(blocks).codes(), blocks.codes.to(torch.int32)), name
    output = file_blocks(model.lm_head.weight, tensors["token_embd.weight"], None, max_rows=64)
    assert output is not None and output.signed  # Q8_0


def test_row_order_is_a_permutation_within_each_head():
    order = llama_row_order(8, 2)
    assert sorted(order.tolist()) == list(range(8)) and order.tolist()[:4] == [0, 2, 1, 3]
    assert np.array_equal(np.sort(order[4:]), np.arange(4, 8))


@pytest.mark.parametrize("shape", ["llama", "gemma"])
@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4", gguf_param()])
def test_speculation_is_exact_against_plain_decoding_with_the_same_weights(request, tmp_path, weights, shape):
    model_dir = request.getfixturevalue(f"tiny_{shape}_dir" if shape == "gemma" else "tiny_model_dir")

    def engine(drafter):
        return Engine(EngineConfig(
            model=ModelConfig(model=model_dir, device="cpu", weights=weights, cache_dir=str(tmp_path)),
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


def test_a_cpu_without_the_kernels_serves_a_gguf_in_float32_and_says_why(monkeypatch, caplog):
    from engine.model.weights import resolve_weights

    gguf = resolve_model_source(None).gguf_path
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "none")  # as a CPU with neither AVX2 nor AVX512-VNNI
    with caplog.at_level("WARNING", logger="specserve.engine"):
        assert resolve_weights("auto", torch.device("cpu"), gguf) == "float32"
    assert "integer kernels need a CPU with AVX2 or AVX512-VNNI" in caplog.text
    with pytest.raises(ValueError, match="--weights gguf needs a CPU with AVX2"):
        resolve_weights("gguf", torch.device("cpu"), gguf)
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "avx2")
    assert resolve_weights("auto", torch.device("cpu"), gguf) == "gguf"
