"""The lean decoder: transformers' logits in fewer calls; fused Linear layers compute their parts' numbers; which
models it serves.

Its torch path (CUDA, bfloat16 activations, no C++ compiler) gives transformers' logits bit for bit. On the CPU with
float32 activations its fused operators (engine/model/csrc/fused_ops.cpp) round the norms' sums and the activations'
exp differently from torch's in the last bits, so there the logits are transformers' within a small tolerance (a
last-bit difference grows where a weight mode rounds activations to bfloat16) and every greedy pick is the same;
batch invariance, a token's logits bit for bit whatever forward computes them, holds on both paths
(tests/engine/model/test_packed_runner.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

import engine.model.decoder as decoder
import engine.model.packed_runner as packed_runner
from engine.model import block_linear, paged_attention
from engine.model.blocks import BlockWeights
from engine.model.cpu_kernels import fused_ops_available
from engine.model.decoder import supports
from engine.model.forward import ForwardBatch, chain_item, tree_item
from engine.model.paged_attention import PagedKVPool, kv_shape
from engine.model.weights import Bf16Linear, Int4Linear, Int8Linear, OutputSlice, apply_weights, fuse_linears
from tests.engine.helpers import gguf_param

BLOCK_SIZE = 4
MODES = ["float32", "bfloat16", "int8", "int4", gguf_param()]
# the fused path's largest difference from transformers' logits, relative to the row's largest logit: float32 and
# gguf activations carry the last-bit differences as they are (measured: below 1e-6); the other modes round
# activations to bfloat16, where one flipped rounding moves a logit by a part in a few hundred (measured: 5e-3)
RELATIVE_TOLERANCE = {"float32": 1e-5, "gguf": 1e-5, "bfloat16": 2e-2, "int8": 2e-2, "int4": 2e-2}


def runner_for(model_dir, weights, lean, monkeypatch, fused=True, num_slots=64 * BLOCK_SIZE):
    """A runner over MODEL_DIR's model: the lean decoder (its fused operators where FUSED and they run here) or, not
    LEAN, transformers' forward. Sequences are read in place only where their padded keys fit in NUM_SLOTS."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    apply_weights(model, weights)
    num_layers, kv_heads, head_dim = kv_shape(model.config)
    pool = PagedKVPool(num_layers, num_slots, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    with monkeypatch.context() as patch:
        if not lean:
            patch.setattr(packed_runner, "supports", lambda model: False)
        runner = packed_runner.PackedModelRunner(model, torch.device("cpu"), pool, BLOCK_SIZE)
    assert (runner.decoder is not None) == lean
    if lean:
        assert runner.decoder.fuses == fused_ops_available()
        runner.decoder.fuses &= fused
    return runner


def steps_of_both_kinds():
    """A prefill beside a decoding request, then a decoding step beside a prefill chunk, then a tree of drafts."""
    tables = {"a": list(range(0, 8)), "b": list(range(8, 16))}
    return [
        [
            chain_item([1, 5, 9, 13, 7, 3, 22, 4, 8], 0, tables["a"], BLOCK_SIZE, 9),
            chain_item([1, 30], 0, tables["b"], BLOCK_SIZE),
        ],
        [chain_item([11], 9, tables["a"], BLOCK_SIZE), chain_item(list(range(10, 28)), 2, tables["b"], BLOCK_SIZE, 3)],
        [tree_item([6, 7, 8, 9], [-1, 0, 0, 2], 10, tables["a"], BLOCK_SIZE, [0, 1, 2, 3])],
    ]


@pytest.mark.parametrize("weights", MODES)
def test_the_lean_decoders_torch_path_gives_transformers_logits_bit_for_bit(tiny_model_dir, weights, monkeypatch):
    """Every logit row equal to transformers' forward's over the same pool layout, with each weight mode (fused
    projections included), where the lean decoder runs torch's operators."""
    runners = [runner_for(tiny_model_dir, weights, lean, monkeypatch, fused=False) for lean in (False, True)]
    for items in steps_of_both_kinds():
        reference, lean = (runner.execute(ForwardBatch(items)).logits for runner in runners)
        for expected, got in zip(reference, lean):
            assert torch.equal(expected, got)


@pytest.mark.skipif(not fused_ops_available(), reason="the fused operators need a C++ compiler on x86-64")
@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_gemma_dir"])
@pytest.mark.parametrize("weights", MODES)
def test_the_fused_lean_decoder_gives_transformers_logits_within_a_rounding(request, model, weights, monkeypatch):
    """The same steps with the fused operators, on the Llama form and on Gemma 3's (query and key norms, norms after
    attention and the MLP, GELU-tanh): every logit row within RELATIVE_TOLERANCE of transformers', the same argmax."""
    model_dir = request.getfixturevalue(model)
    runners = [runner_for(model_dir, weights, lean, monkeypatch) for lean in (False, True)]
    for items in steps_of_both_kinds():
        reference, lean = (runner.execute(ForwardBatch(items)).logits for runner in runners)
        for expected, got in zip(reference, lean):
            scale = expected.abs().amax(dim=-1, keepdim=True)
            assert ((got - expected).abs() <= RELATIVE_TOLERANCE[weights] * scale).all()
            assert torch.equal(got.argmax(dim=-1), expected.argmax(dim=-1))


@pytest.mark.skipif(not fused_ops_available(), reason="the fused operators need a C++ compiler on x86-64")
@pytest.mark.parametrize("weights", [gguf_param()])
@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_gemma_dir"])
@pytest.mark.parametrize("concatenated", [False, True], ids=["one-part", "parts"])
def test_a_whole_layer_in_one_call_gives_its_operators_bits(request, model, weights, concatenated, monkeypatch):
    """decoder_layer (engine/model/csrc/decoder_layer.cpp) gives the logits of the same layers' fused operators
    called one by one, bit for bit, in every step of both kinds, Llama and Gemma 3 forms; also where a Linear is
    parts of different block types (ConcatenatedLinear: one kernel call each)."""
    if concatenated:
        def refuse(parts):
            raise ValueError("as if the parts' block types differed")
        monkeypatch.setattr(block_linear, "concatenate", refuse)
    model_dir = request.getfixturevalue(model)
    whole, one_by_one = (runner_for(model_dir, weights, True, monkeypatch, num_slots=1024) for _ in range(2))
    assert [len(layer.whole_layer_args[2]) for layer in whole.decoder.layers[:1]] == [4]
    assert whole.decoder.layers[0].whole_layer_args[2] == ([3, 1, 2, 1] if concatenated else [1, 1, 1, 1])
    for layer in one_by_one.decoder.layers:
        layer.whole_layer_args = None
    whole_layer_calls, in_place_spans = [], decoder.in_place_spans
    monkeypatch.setattr(decoder, "in_place_spans", lambda *args: whole_layer_calls.append(in_place_spans(*args)) or
                        whole_layer_calls[-1])
    steps = steps_of_both_kinds()
    for items in steps:
        expected, got = (runner.execute(ForwardBatch(items)).logits for runner in (one_by_one, whole))
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert len(whole_layer_calls) == len(steps) * len(whole.decoder.layers)
    assert all(spans is not None for spans in whole_layer_calls)


@pytest.mark.parametrize("path", ["whole-layer", "operators", "torch"])
def test_the_cpu_pools_head_major_layout_changes_no_bit(tiny_model_dir, path, monkeypatch):
    """The CPU pool lies head by head (engine/model/paged_attention.py PagedKVPool); a runner over a pool laid out
    slot by slot, as on CUDA, gives every logit row bit for bit, on the whole-layer kernel, the fused operators one
    by one and the torch path, through prefill, decoding beside a prefill chunk, and a tree."""
    head_major = runner_for(tiny_model_dir, "gguf", True, monkeypatch, fused=path != "torch", num_slots=1024)
    with monkeypatch.context() as patch:
        patch.setattr(paged_attention, "_pool_tensor", paged_attention.slot_major_zeros)
        by_slot = runner_for(tiny_model_dir, "gguf", True, monkeypatch, fused=path != "torch", num_slots=1024)
    assert by_slot.pool.keys.is_contiguous() and head_major.pool.keys.transpose(1, 2).is_contiguous()
    if path == "operators":
        for layer in (*head_major.decoder.layers, *by_slot.decoder.layers):
            layer.whole_layer_args = None
    for items in steps_of_both_kinds():
        expected, got = (runner.execute(ForwardBatch(items)).logits for runner in (by_slot, head_major))
        assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("fused", [False, True])
def test_a_hidden_state_capture_is_the_layers_output(tiny_model_dir, fused, monkeypatch):
    """transformers' hidden state after the first layer: bit for bit on the torch path, within a rounding fused."""
    from drafters.base import CaptureSpec

    runners = [runner_for(tiny_model_dir, "float32", lean, monkeypatch, fused) for lean in (False, True)]
    item = chain_item([1, 5, 9, 13, 7], 0, list(range(4)), BLOCK_SIZE)
    item.hidden_rows = [0, 3, 4]
    outputs = [runner.execute(ForwardBatch([item], CaptureSpec(hidden_layers=(1,)))) for runner in runners]
    assert outputs[1].hidden[0].shape == (3, 32)
    if runners[1].decoder.fuses:
        torch.testing.assert_close(outputs[1].hidden[0], outputs[0].hidden[0], rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(outputs[0].hidden[0], outputs[1].hidden[0])


def linears(kind: str, sizes: list[int], in_features: int = 64) -> list[torch.nn.Module]:
    generator = torch.Generator().manual_seed(len(sizes))
    weights = [torch.randn(size, in_features, generator=generator) for size in sizes]
    if kind == "float32":
        return [_float_linear(weight) for weight in weights]
    if kind == "bfloat16":
        return [Bf16Linear(weight) for weight in weights]
    if kind == "int8":
        return [Int8Linear.from_weight(weight) for weight in weights]
    if kind == "gguf":
        from engine.model.block_linear import BlockLinear

        return [BlockLinear.from_blocks(BlockWeights.by_range(weight)) for weight in weights]
    return [Int4Linear.from_blocks(BlockWeights.by_range(weight)) for weight in weights]


def _float_linear(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=True)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


@pytest.mark.parametrize("kind", MODES)
def test_a_fused_linear_computes_its_parts_numbers_and_leaves_them_usable(kind):
    """Parts of 48, 16 and 16 channels: the int4 kernel packs output channels in blocks of its own, so the parts
    do not line up with them; the codes are read back through the kernel and packed again."""
    parent = torch.nn.Module()
    names = ("q", "k", "v")
    parts = linears(kind, [48, 16, 16])
    for name, part in zip(names, parts):
        setattr(parent, name, part)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = [part(x) for part in parts]
        fused = fuse_linears(parent, names)
        assert torch.equal(fused(x), torch.cat(expected, dim=-1))
        for name, part_out in zip(names, expected):
            assert isinstance(getattr(parent, name), OutputSlice)
            assert torch.equal(getattr(parent, name)(x), part_out)
    assert fuse_linears(parent, names) is fused  # fused once, however many runners ask


def test_int4_parts_of_whole_packing_blocks_concatenate_without_unpacking():
    """Parts of 128 and 64 channels (the embedded model's are 576, 192, 192 and 1536, 1536): their packed buffers
    joined are the packing of the joined codes, so fusing them reads no codes back."""
    parent = torch.nn.Module()
    parent.a, parent.b = linears("int4", [128, 64])
    codes = torch.cat([parent.a.codes(), parent.b.codes()])
    fused = fuse_linears(parent, ("a", "b"))
    assert torch.equal(fused.packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))


def test_the_int4_codes_come_back_from_the_kernels_packing():
    blocks = BlockWeights.by_range(torch.randn(80, 64, generator=torch.Generator().manual_seed(4)))
    assert torch.equal(Int4Linear.from_blocks(blocks).codes(), blocks.codes.to(torch.int32))


def test_llama_form_models_get_the_lean_decoder_and_others_transformers_forward(tiny_model_dir):
    assert supports(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    assert not supports(AutoModelForCausalLM.from_config(LlamaConfig(**tiny, hidden_act="gelu")))
    assert not supports(AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64)))
