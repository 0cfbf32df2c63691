"""The start-up latency profile: every count measured, the fastest round kept, slow counts measured less often,
counts past the row kernels' limit spread over several sequences as a busy step holds them, the profile's blocks
given back."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model import profiler
from engine.model.attention_layout import MAX_PAGED_ROWS_QUERY_LEN
from engine.model.packed_runner import PackedModelRunner
from engine.model.paged_attention import PagedKVPool
from scheduler.kv_blocks import KVBlockManager

BLOCK_SIZE = 4
NUM_BLOCKS = 512


@pytest.mark.parametrize("budget_s", [0.0, 1e9])
def test_profile_keeps_each_counts_fastest_round_and_frees_its_blocks(tiny_model_dir, monkeypatch, budget_s):
    """With no time budget each count is measured once; with an unbounded one, every round."""
    monkeypatch.setattr(profiler, "PROFILE_SECONDS_PER_COUNT", budget_s)
    runner, config = _tiny_runner(tiny_model_dir, NUM_BLOCKS)
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


def _tiny_runner(model_dir: str, num_blocks: int):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    pool = PagedKVPool(config.num_hidden_layers, num_blocks * BLOCK_SIZE, config.num_key_value_heads, head_dim,
                       torch.float32, torch.device("cpu"))
    return PackedModelRunner(model, torch.device("cpu"), pool, BLOCK_SIZE), config


def _recorded_chain_lengths(runner, blocks, vocab_size, monkeypatch) -> dict[int, list[int]]:
    """Each profiled count's chain lengths, one per sequence of its forward (every count measured once)."""
    monkeypatch.setattr(profiler, "PROFILE_SECONDS_PER_COUNT", 0.0)
    lengths: dict[int, list[int]] = {}
    batch_seconds = profiler._batch_seconds

    def recording(runner, batch):
        lengths[sum(item.num_tokens for item in batch.items)] = [item.num_tokens for item in batch.items]
        return batch_seconds(runner, batch)

    monkeypatch.setattr(profiler, "_batch_seconds", recording)
    profiler.profile_forward_latency(runner, blocks, vocab_size, max_model_len=1024)
    return lengths


@pytest.mark.parametrize("context_len", [profiler.PROFILE_CONTEXT_LEN, 510])  # whole blocks, and 2 positions short
def test_counts_past_the_row_kernels_limit_are_chains_of_several_sequences(tiny_model_dir, monkeypatch, context_len):
    """128 and 256 tokens are 2 and 4 sequences' chains of 64 (a busy decoding step, which the row kernels attend
    and a GPU replays as a graph), not one sequence's prefill chunk; 64 and fewer stay one chain. The context is
    prefilled once, the other sequences sharing its whole blocks (and prefilling the rest of a partial one)."""
    monkeypatch.setattr(profiler, "PROFILE_CONTEXT_LEN", context_len)
    num_blocks = 2 * (profiler.PROFILE_CONTEXT_LEN + 256) // BLOCK_SIZE
    runner, config = _tiny_runner(tiny_model_dir, num_blocks)
    blocks = KVBlockManager(num_blocks, BLOCK_SIZE)
    prefilled = []
    execute = runner.execute

    def recording(batch):
        prefilled.extend(item.num_tokens for item in batch.items if item.num_cached < context_len)
        return execute(batch)

    monkeypatch.setattr(runner, "execute", recording)
    lengths = _recorded_chain_lengths(runner, blocks, config.vocab_size, monkeypatch)
    assert lengths[64] == [64] and lengths[8] == [8]
    assert lengths[128] == [MAX_PAGED_ROWS_QUERY_LEN] * 2 and lengths[256] == [MAX_PAGED_ROWS_QUERY_LEN] * 4
    assert prefilled == [context_len] + [context_len % BLOCK_SIZE] * 3 * bool(context_len % BLOCK_SIZE)
    assert blocks.num_free_blocks == num_blocks and not blocks.block_tables
