"""Start-up profile of forward latency against the number of tokens in the packed forward, and of what each
root-to-leaf path of a draft tree adds (scheduler/latency.py prices trees by their paths).

A count above MAX_PAGED_ROWS_QUERY_LEN is measured as several sequences' chains of at most that many tokens each, the
shape of a busy decoding or verifying step (many requests, a few tokens each, every row reading its own sequence's
keys), not as one sequence's prefill chunk. Timed as a prefill chunk on an H200 when chunks ran eagerly, 128 tokens
cost 16-30 ms against 3 ms for 64 in a CUDA graph, and the planner verified almost none of the drafts at 64 clients."""
from __future__ import annotations

import time

import torch

from engine.model.attention_layout import MAX_PAGED_ROWS_QUERY_LEN
from engine.model.forward import ForwardBatch, chain_item, tree_item
from engine.model.packed_runner import PackedModelRunner
from scheduler.kv_blocks import KVBlockManager

PROFILE_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the latency model extrapolates linearly beyond
PROFILE_CONTEXT_LEN = 512
PROFILE_ROUNDS = 5  # passes over the token counts at most; each count keeps its fastest
PROFILE_SECONDS_PER_COUNT = 0.25  # a count is measured again while its measurements add up to less than this
PROFILE_PATH_ROUNDS = 3  # measurements of the tree and of the chain it is compared with; each keeps its fastest
PROFILE_REQUEST_ID = "__latency_profile__"
PROFILE_TREE_PATHS, PROFILE_PATH_LEN = 8, 4  # the profiled tree: 8 branches of 4 tokens off the context


@torch.inference_mode()
def profile_forward_latency(
    runner: PackedModelRunner, blocks: KVBlockManager, vocab_size: int, max_model_len: int
) -> dict[int, float]:
    """Seconds of a forward over n new tokens after a fixed context, for each profiled n: the fastest of a few
    rounds, since interference only ever adds time. Each round measures every count, so a burst of interference
    (the server process starting beside the engine, say) slows one round rather than every repeat of one count,
    which would skew the ratios the planner weighs drafts by. A count's later rounds are skipped once it has been
    measured for PROFILE_SECONDS_PER_COUNT in all: a forward of hundreds of tokens varies by a few per cent between
    rounds (one measurement of it is enough), a forward of one token by far more, and the large ones are most of the
    start-up's time."""
    counts = [n for n in PROFILE_TOKEN_COUNTS if n < max_model_len // 2]
    context_len = min(PROFILE_CONTEXT_LEN, max_model_len - max(counts))
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab_size, (context_len + max(counts),), generator=generator).tolist()
    tables = _profile_sequences(runner, blocks, context, context_len, _num_sequences(max(counts)))
    try:
        fastest = {n: float("inf") for n in counts}
        spent = {n: 0.0 for n in counts}
        for round_index in range(PROFILE_ROUNDS):
            for n in counts:
                if round_index and spent[n] >= PROFILE_SECONDS_PER_COUNT:
                    continue
                seconds = _forward_seconds(runner, tables, context, context_len, n)
                fastest[n], spent[n] = min(fastest[n], seconds), spent[n] + seconds
        return fastest
    finally:
        for index in range(len(tables)):
            blocks.free(_sequence_id(index))


@torch.inference_mode()
def profile_path_seconds(
    runner: PackedModelRunner, blocks: KVBlockManager, vocab_size: int, max_model_len: int
) -> float:
    """Seconds each root-to-leaf path beyond the first adds per position of context: a tree of PROFILE_TREE_PATHS
    branches against a chain of as many tokens, after the same context (fastest of a few rounds each). About zero
    where trees are attended in place (the CPU row kernel); each path re-reads the context elsewhere."""
    num_tokens = PROFILE_TREE_PATHS * PROFILE_PATH_LEN
    context_len = min(PROFILE_CONTEXT_LEN, max_model_len // 2)
    context = torch.randint(
        0, vocab_size, (context_len + num_tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    table = blocks.grow(PROFILE_REQUEST_ID, len(context))
    try:
        runner.execute(ForwardBatch([chain_item(context[:context_len], 0, table, blocks.block_size)]))
        drafted = context[context_len:]
        rows = list(range(num_tokens))
        chain = chain_item(drafted, context_len, table, runner.block_size, num_tokens)
        tree = tree_item(
            drafted, _branches(PROFILE_TREE_PATHS, PROFILE_PATH_LEN), context_len, table, runner.block_size, rows
        )
        chain_s = min(_batch_seconds(runner, ForwardBatch([chain])) for _ in range(PROFILE_PATH_ROUNDS))
        tree_s = min(_batch_seconds(runner, ForwardBatch([tree])) for _ in range(PROFILE_PATH_ROUNDS))
        return max(tree_s - chain_s, 0.0) / (PROFILE_TREE_PATHS - 1) / context_len
    finally:
        blocks.free(PROFILE_REQUEST_ID)


def _num_sequences(num_tokens: int) -> int:
    """Sequences a profiled step of NUM_TOKENS spreads its chains over: at most MAX_PAGED_ROWS_QUERY_LEN tokens each."""
    return -(-num_tokens // MAX_PAGED_ROWS_QUERY_LEN)


def _sequence_id(index: int) -> str:
    return PROFILE_REQUEST_ID if index == 0 else f"{PROFILE_REQUEST_ID}:{index}"


def _profile_sequences(
    runner: PackedModelRunner, blocks: KVBlockManager, context: list[int], context_len: int, num_sequences: int
) -> list[list[int]]:
    """Block tables of NUM_SEQUENCES profile sequences, each holding CONTEXT's first CONTEXT_LEN tokens in its KV and
    room for its share of the rest of CONTEXT. The first prefills the context; the others share its whole blocks (a
    reused prefix, as sessions share them) and prefill only what is left of the context past them, so start-up pays
    for one prefill whatever the count."""
    length = context_len + -(-(len(context) - context_len) // num_sequences)
    first = blocks.grow(_sequence_id(0), length)
    runner.execute(ForwardBatch([chain_item(context[:context_len], 0, first, blocks.block_size)]))
    shared = context_len // blocks.block_size * blocks.block_size
    tables = [first]
    for index in range(1, num_sequences):
        blocks.share(_sequence_id(index), first[:shared // blocks.block_size])
        tables.append(blocks.grow(_sequence_id(index), length))
    if shared < context_len and len(tables) > 1:
        runner.execute(ForwardBatch([chain_item(context[shared:context_len], shared, table, blocks.block_size)
                                     for table in tables[1:]]))
    return tables


def _branches(num_paths: int, path_len: int) -> list[int]:
    """Parents of NUM_PATHS chains of PATH_LEN tokens, each hanging off the context."""
    return [-1 if depth == 0 else path * path_len + depth - 1 for path in range(num_paths) for depth in range(path_len)]


def _forward_seconds(
    runner: PackedModelRunner, tables: list[list[int]], context: list[int], context_len: int, num_tokens: int
) -> float:
    """Seconds of one forward of NUM_TOKENS new tokens after CONTEXT_LEN cached ones, spread evenly over as many of
    the profile's sequences (TABLES) as keep each chain within MAX_PAGED_ROWS_QUERY_LEN tokens."""
    num_sequences = _num_sequences(num_tokens)
    sizes = [num_tokens // num_sequences + (index < num_tokens % num_sequences) for index in range(num_sequences)]
    items = [chain_item(context[context_len:context_len + size], context_len, table, runner.block_size, size)
             for size, table in zip(sizes, tables)]
    return _batch_seconds(runner, ForwardBatch(items))


def _batch_seconds(runner: PackedModelRunner, batch: ForwardBatch) -> float:
    start = time.perf_counter()
    runner.execute(batch)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start
