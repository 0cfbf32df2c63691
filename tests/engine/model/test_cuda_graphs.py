"""CUDA graphs' static buffers, run eagerly on the CPU (the capture itself needs a GPU: the `gpu` tests in
tests/engine/test_engine.py): a step of short chains copied into the buffers, padded up to the ladder's size, gives
the eager runner's logits, a prefill chunk past the ancestor bits the SDPA backend's; what a graph cannot compute
runs eagerly."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model.cuda_graphs import CudaGraphs
from engine.model.forward import ForwardBatch, chain_item, tree_item
from engine.model.packed_runner import PackedModelRunner
from engine.model.paged_attention import PagedKVPool, triton_available
from scheduler.kv_blocks import KVBlockManager

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # on a CPU: Triton's interpreter
pytestmark = pytest.mark.skipif(not triton_available(DEVICE), reason="needs the triton package (a test dependency)")
BLOCK_SIZE = 4
NUM_BLOCKS = 32  # the block manager's; the pool has one more, the spare


class EagerReplay:
    """Stands in for a captured graph: a replay recomputes the size's forward from the static buffers."""

    def __init__(self, graphs: CudaGraphs, size: int, logits: torch.Tensor) -> None:
        self.graphs, self.size, self.logits = graphs, size, logits

    def replay(self) -> None:
        self.logits.copy_(self.graphs._forward(self.size))


def runner_with_pool(tiny_model_dir, backend: str = "triton") -> PackedModelRunner:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(DEVICE).eval()
    config = model.config
    pool = PagedKVPool(config.num_hidden_layers, (NUM_BLOCKS + 1) * BLOCK_SIZE, config.num_key_value_heads,
                       config.hidden_size // config.num_attention_heads, torch.float32, DEVICE)
    return PackedModelRunner(model, DEVICE, pool, BLOCK_SIZE, backend)


@pytest.fixture
def runners(tiny_model_dir):
    eager, graphed = runner_with_pool(tiny_model_dir), runner_with_pool(tiny_model_dir)
    graphs = CudaGraphs(graphed.decoder, graphed.pool, BLOCK_SIZE, NUM_BLOCKS, NUM_BLOCKS, DEVICE,
                        8, graphed.paged_rows_fit)
    vocab = graphed.model.config.vocab_size
    for size in graphs.sizes:
        logits = torch.empty(size, vocab, device=DEVICE)
        graphs.graphs[size] = (EagerReplay(graphs, size, logits), logits)
    graphed.graphs = graphs
    return eager, graphed


def test_a_padded_replay_gives_the_eager_logits_and_writes_only_its_own_kv(runners):
    eager, graphed = runners
    blocks = KVBlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    a, b = [1, 5, 9, 13, 2, 7], [1, 30, 31]
    prefill = ForwardBatch([chain_item(a, 0, blocks.grow("a", len(a)), BLOCK_SIZE),
                            chain_item(b, 0, blocks.grow("b", len(b)), BLOCK_SIZE)])
    assert not graphed.graphs.fits(prefill)  # 9 tokens: beyond the largest size, 8, so eager
    for runner in (eager, graphed):
        runner.execute(prefill)
    step = ForwardBatch([chain_item([4, 8, 12], len(a), blocks.grow("a", len(a) + 3), BLOCK_SIZE, 3),
                         chain_item([11], len(b), blocks.grow("b", len(b) + 1), BLOCK_SIZE)])
    assert graphed.graphs.fits(step)  # 4 tokens: the size-4 graph, no padding; then 2 + 1 = 3 tokens, padded to 4
    next_step = ForwardBatch([chain_item([6, 3], len(a) + 3, blocks.grow("a", len(a) + 5), BLOCK_SIZE, 2),
                              chain_item([17], len(b) + 1, blocks.grow("b", len(b) + 2), BLOCK_SIZE)])
    tree = tree_item([9, 5, 6, 7], [-1, -1, 0, 1], len(a) + 5, blocks.grow("a", len(a) + 9), BLOCK_SIZE, [0, 1, 2, 3])
    tree.drafter_rows = []  # a draft tree, then a look-ahead chain hanging off its last real token
    look_ahead = chain_item([21, 22], len(b) + 2, blocks.grow("b", len(b) + 4), BLOCK_SIZE, 1)
    look_ahead.drafter_rows = [1]
    tree_step = ForwardBatch([tree, look_ahead])
    spare = graphed.pool.keys[:, NUM_BLOCKS * BLOCK_SIZE:]
    spare.fill_(float("nan"))  # whatever lies there, the real rows never read it
    for batch in (step, next_step, tree_step):
        expected, got = eager.execute(batch), graphed.execute(batch)
        for e, g in zip(expected.logits + expected.drafter_logits, got.logits + got.drafter_logits):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    owned = slice(0, NUM_BLOCKS * BLOCK_SIZE)
    torch.testing.assert_close(graphed.pool.keys[:, owned], eager.pool.keys[:, owned], rtol=1e-4, atol=1e-4)
    assert not spare[:, 0].isnan().any() and spare[:, 1:].isnan().all()  # the padding row wrote its spare slot only


def test_captures_and_long_items_run_eagerly(runners):
    _, graphed = runners
    graphs = graphed.graphs
    blocks = KVBlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    chain = chain_item([1, 2], 0, blocks.grow("a", 2), BLOCK_SIZE)
    tree = tree_item([5, 6, 7], [-1, 0, -1], 2, blocks.grow("a", 5), BLOCK_SIZE, [0, 1, 2])
    look_ahead = chain_item([1, 2], 0, blocks.grow("b", 2), BLOCK_SIZE)
    look_ahead.drafter_rows = [1]
    assert graphs.fits(ForwardBatch([chain, look_ahead])) and graphs.fits(ForwardBatch([tree]))
    captured = chain_item([1, 2], 0, blocks.grow("c", 2), BLOCK_SIZE)
    captured.hidden_rows = [0, 1]
    too_many = chain_item(list(range(9)), 0, blocks.grow("d", 9), BLOCK_SIZE)
    for item in (captured, too_many):
        assert not graphs.fits(ForwardBatch([item]))


def test_a_prefill_chunk_past_the_ancestor_bits_replays_a_graph(tiny_model_dir):
    """A 70-token prompt beside a decoding row fits a ladder of up to 128 tokens (padded to 96) and gives the SDPA
    backend's logits: its rows past 64 count the earlier ones as cached."""
    eager, graphed = runner_with_pool(tiny_model_dir, "sdpa"), runner_with_pool(tiny_model_dir)
    graphs = CudaGraphs(graphed.decoder, graphed.pool, BLOCK_SIZE, NUM_BLOCKS, NUM_BLOCKS, DEVICE, 128,
                        graphed.paged_rows_fit)
    for size in graphs.sizes:
        logits = torch.empty(size, graphed.model.config.vocab_size, device=DEVICE)
        graphs.graphs[size] = (EagerReplay(graphs, size, logits), logits)
    graphed.graphs = graphs
    blocks = KVBlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    first = [chain_item([1, 30, 31], 0, blocks.grow("b", 3), BLOCK_SIZE)]
    for runner in (eager, graphed):
        runner.execute(ForwardBatch(first))
    prompt = [1] + [(7 * i) % 25 + 3 for i in range(69)]
    step = ForwardBatch([chain_item(prompt, 0, blocks.grow("a", len(prompt)), BLOCK_SIZE, 2),
                         chain_item([11], 3, blocks.grow("b", 4), BLOCK_SIZE)])
    assert graphs.fits(step)
    expected, got = eager.execute(step), graphed.execute(step)
    for e, g in zip(expected.logits, got.logits):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
