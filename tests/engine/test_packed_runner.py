"""A packed, ragged forward over the paged pool gives each request the logits of its own forward."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from transformers import DynamicCache

from engine.packed_runner import ForwardItem, PackedModelRunner
from engine.paged_attention import PagedKVPool
from scheduler.kv_blocks import KVBlockManager

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    packed = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    config = packed.config
    head_dim = config.hidden_size // config.num_attention_heads
    pool = PagedKVPool(config.num_hidden_layers, 64 * BLOCK_SIZE, config.num_key_value_heads, head_dim, torch.float32, torch.device("cpu"))
    return reference, PackedModelRunner(packed, torch.device("cpu"), pool)


def reference_logits(model, cache, token_ids, num_logits):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([token_ids]), past_key_values=cache, use_cache=True, logits_to_keep=num_logits)
    return out.logits[0]


@pytest.mark.parametrize("read_in_place", [True, False], ids=["contiguous-read-in-place", "all-gathered"])
def test_packed_steps_match_per_request_forwards_through_prefill_drafts_and_rollback(models, read_in_place, monkeypatch):
    reference, runner = models
    monkeypatch.setattr(runner, "in_place_min_context", 1 if read_in_place else 10**9)
    attended = {"in place": 0, "gathered": 0}
    split = runner._in_place_spans

    def counting_split(*args):
        spans, gathered = split(*args)
        attended["in place"] += len(spans)
        attended["gathered"] += len(gathered)
        return spans, gathered

    monkeypatch.setattr(runner, "_in_place_spans", counting_split)
    blocks = KVBlockManager(num_blocks=21, block_size=BLOCK_SIZE)  # exactly enough: some tables end up fragmented
    long_prompt = [1] + [(7 * i) % 40 + 3 for i in range(39)]  # prefilled in two chunks, the first without logits
    prompts = {"a": [1, 5, 9, 13, 7, 3, 22], "b": [1, 30, 31], "c": [1] + list(range(10, 28)), "d": long_prompt[:25]}
    caches = {name: DynamicCache() for name in prompts}
    computed = {name: 0 for name in prompts}

    def step(new_tokens, num_logits):
        items = []
        for name, ids in new_tokens.items():
            blocks.grow(name, computed[name] + len(ids))
            items.append(ForwardItem(name, ids, computed[name], num_logits[name]))
        got = runner.execute(items, blocks)
        for (name, ids), logits in zip(new_tokens.items(), got):
            if caches[name].get_seq_length() > computed[name]:
                caches[name].crop(computed[name] - caches[name].get_seq_length())
            expected = reference_logits(reference, caches[name], ids, num_logits[name])
            assert logits.shape[0] == num_logits[name]
            if num_logits[name]:
                torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
            computed[name] += len(ids)

    step(prompts, {"a": 1, "b": 1, "c": 1, "d": 0})  # ragged prefill; d's chunk stops short of its prompt's end
    step({"d": long_prompt[25:]}, {"d": 1})
    step({"a": [4, 8, 12], "b": [6], "c": [2, 2]}, {"a": 3, "b": 1, "c": 2})  # last token + drafts
    for name, keep in (("a", 1), ("c", 2)):  # rejected drafts: roll back
        computed[name] -= keep
        blocks.shrink(name, computed[name])
    step({"a": [40, 41], "b": [7, 8, 9, 10, 11], "c": [3]}, {"a": 2, "b": 5, "c": 1})
    assert attended["gathered"] > 0
    assert (attended["in place"] > 0) == read_in_place


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash-attn backend needs a CUDA device")
def test_flash_backend_matches_sdpa_on_cuda(tiny_model_dir):
    pytest.importorskip("flash_attn", reason="the flash-attn backend needs the flash-attn package")
    from engine.paged_attention import FLASH_BLOCK_SIZE

    device = torch.device("cuda")
    runners, blocks = {}, {}
    for backend in ("sdpa", "flash"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).to(device).eval()
        config = model.config
        head_dim = config.hidden_size // config.num_attention_heads
        pool = PagedKVPool(config.num_hidden_layers, 8 * FLASH_BLOCK_SIZE, config.num_key_value_heads, head_dim, torch.bfloat16, device)
        runners[backend] = PackedModelRunner(model, device, pool, backend)
        blocks[backend] = KVBlockManager(num_blocks=8, block_size=FLASH_BLOCK_SIZE)
    prompts = {"a": [1] + list(range(3, 40)), "b": [1, 30, 31]}
    steps = [
        ({"a": prompts["a"], "b": prompts["b"]}, {"a": 1, "b": 1}),
        ({"a": [4, 8, 12], "b": [6]}, {"a": 3, "b": 1}),
    ]
    logits = {}
    for backend, runner in runners.items():
        computed, logits[backend] = {"a": 0, "b": 0}, []
        for new_tokens, num_logits in steps:
            items = []
            for name, ids in new_tokens.items():
                blocks[backend].grow(name, computed[name] + len(ids))
                items.append(ForwardItem(name, ids, computed[name], num_logits[name]))
                computed[name] += len(ids)
            logits[backend] += runner.execute(items, blocks[backend])
    for sdpa, flash in zip(logits["sdpa"], logits["flash"]):
        torch.testing.assert_close(flash, sdpa, rtol=2e-2, atol=2e-2)  # bfloat16 kernels sum in different orders
