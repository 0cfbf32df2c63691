"""Start-up profile of forward latency against the number of tokens in the packed forward."""
from __future__ import annotations

import time

import torch

from engine.forward import ForwardBatch, chain_item
from engine.packed_runner import PackedModelRunner
from scheduler.kv_blocks import KVBlockManager

PROFILE_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the latency model extrapolates linearly beyond
PROFILE_CONTEXT_LEN = 512
PROFILE_ROUNDS = 5  # passes over every token count; each count keeps its fastest
PROFILE_REQUEST_ID = "__latency_profile__"


@torch.inference_mode()
def profile_forward_latency(runner: PackedModelRunner, blocks: KVBlockManager, vocab_size: int, max_model_len: int) -> dict[int, float]:
    """Seconds of a forward over n new tokens after a fixed context, for each profiled n: the fastest of a few
    rounds, since interference only ever adds time. Each round measures every count, so a burst of interference
    (the server process starting beside the engine, say) slows one round rather than every repeat of one count,
    which would skew the ratios the planner weighs drafts by."""
    counts = [n for n in PROFILE_TOKEN_COUNTS if n < max_model_len // 2]
    context_len = min(PROFILE_CONTEXT_LEN, max_model_len - max(counts))
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab_size, (context_len + max(counts),), generator=generator).tolist()
    table = blocks.grow(PROFILE_REQUEST_ID, len(context))
    try:
        runner.execute(ForwardBatch([chain_item(context[:context_len], 0, table, blocks.block_size)]))
        fastest = {n: float("inf") for n in counts}
        for _ in range(PROFILE_ROUNDS):
            for n in counts:
                fastest[n] = min(fastest[n], _forward_seconds(runner, table, context, context_len, n))
        return fastest
    finally:
        blocks.free(PROFILE_REQUEST_ID)


def _forward_seconds(runner: PackedModelRunner, table: list[int], context: list[int], context_len: int, num_tokens: int) -> float:
    item = chain_item(context[context_len:context_len + num_tokens], context_len, table, runner.block_size, num_tokens)
    start = time.perf_counter()
    runner.execute(ForwardBatch([item]))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start
