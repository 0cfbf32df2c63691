"""The start-up latency profile: every count measured, the fastest round kept, slow counts measured less often,
the profile's blocks given back."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model import profiler
from engine.model.packed_runner import PackedModelRunner
from engine.model.paged_attention import PagedKVPool
from scheduler.kv_blocks import KVBlockManager

BLOCK_SIZE = 4
NUM_BLOCKS = 512


@pytest.mark.parametrize("budget_s", [0.0, 1e9])
def test_profile_keeps_each_counts_fastest_round_and_frees_its_blocks(tiny_model_dir, monkeypatch, budget_s):
    """With no time budget each count is measured once; with an unbounded one, every round."""
    monkeypatch.setattr(profiler, "PROFILE_SECONDS_PER_COUNT", budget_s)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    pool = PagedKVPool(config.num_hidden_layers, NUM_BLOCKS * BLOCK_SIZE, config.num_key_value_heads, head_dim,
                       torch.float32, torch.device("cpu"))
    runner = PackedModelRunner(model, torch.device("cpu"), pool, BLOCK_SIZE)
    blocks = KVBlockManager(NUM_BLOCKS, BLOCK_SIZE)
    measured: dict[int, list[float]] = {}
    forward_seconds = profiler._forward_seconds

    def recording(runner, table, context, context_len, num_tokens):
        measured.setdefault(num_tokens, []).append(forward_seconds(runner, table, context, context_len, num_tokens))
        return measured[num_tokens][-1]

    monkeypatch.setattr(profiler, "_forward_seconds", recording)
    profile = profiler.profile_forward_latency(runner, blocks, config.vocab_size, max_model_len=128)
    assert list(profile) == [n for n in profiler.PROFILE_TOKEN_COUNTS if n < 64]
    for n, seconds in profile.items():
        rounds = profiler.PROFILE_ROUNDS if budget_s else 1
        assert len(measured[n]) == rounds and seconds == min(measured[n]) > 0
    assert blocks.num_free_blocks == NUM_BLOCKS and not blocks.block_tables
