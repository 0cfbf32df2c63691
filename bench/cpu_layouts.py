"""`specserve bench cpu-layouts --compare WHAT`: forward time of a memory layout or kernel variant the CPU forward uses
against the one it replaced, in one process.

- `kv-pool`: the KV pool, `[layers, slots, kv_heads, head_dim]` by shape everywhere, lies head by head in the CPU's
  memory (engine/model/paged_attention.py PagedKVPool), against slot by slot (CUDA's layout);
- `scales`: the `gguf` weights' scales and minimums stored as float16 where each is exactly a half
  (engine/model/block_linear.py), against float32 throughout;
- `amx`: block_linear's AMX variant (engine/model/csrc/block_linear_amx.h: 16 rows a tile multiply, from 16 rows for
  signed codes, 32 for unsigned), against its AVX512-VNNI variant alone (SPECSERVE_CPU_ISA=avx512vnni). It needs a
  CPU with AMX-INT8 whose kernel grants the tile state; elsewhere both engines run the same variant.

Two engines on the served model, the second made with the layout or variant it replaced (patched here only), take
turns forward by forward: for each batch size B and context length C, B sequences of C distinct tokens are prefilled,
then each engine runs forwards of N new tokens per sequence (a decode step at N = 1, a verify step of N - 1 drafted
tokens above it), REPEATS times in turn. Both give the same bits (tests/engine/model/test_decoder.py,
tests/engine/model/test_block_linear.py); what differs is how many bytes a step reads and how they stream, or which
instructions multiply them. Each figure is the median over the repeats.
"""
from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

import engine.model.block_linear as block_linear
import engine.model.paged_attention as paged_attention
from engine.engine import Engine
from engine.model.forward import ForwardBatch, chain_item

REPEATS = 20


def _float32_scales(scales, mins):
    return scales, mins


# what is compared -> (the layout in use, the one it replaced, the patch that builds an engine with the latter)
COMPARISONS = {
    "kv-pool": ("head-major", "slot-major", mock.patch.object(paged_attention, "_pool_tensor",
                                                              paged_attention.slot_major_zeros)),
    "scales": ("float16 where exact", "float32", mock.patch.object(block_linear, "_stored", _float32_scales)),
    "amx": ("AMX", "AVX512-VNNI", mock.patch.dict(os.environ, {"SPECSERVE_CPU_ISA": "avx512vnni"})),
}


def add_cpu_layouts_flags(parser) -> None:
    parser.add_argument("--compare", choices=list(COMPARISONS), required=True, help="which layout to compare")
    parser.add_argument("--contexts", default="64,256,512,1024,2048", help="context lengths, comma-separated")
    parser.add_argument("--batch-sizes", default="1,16", help="sequences per forward, comma-separated")
    parser.add_argument("--new-tokens", default="1,2,4", help="new tokens per sequence per forward, comma-separated")
    parser.add_argument("--max-batch-context", type=int, default=1024,
                        help="contexts above this are measured at batch 1 only (their prefill at batch 16 is long)")


def _engines(config, compare: str) -> dict[str, Engine]:
    """{"before": an engine with the replaced layout, "now": one as served}."""
    with COMPARISONS[compare][2]:
        before = Engine(config)
    return {"before": before, "now": Engine(config)}


def _sequences(engine: Engine, contexts: list[list[int]]) -> list[list[int]]:
    """Prefills each context as a sequence of its own -> their block tables (room for 16 more tokens each)."""
    blocks, tables = engine.scheduler.blocks, []
    for index, context in enumerate(contexts):
        table = blocks.grow(f"cpu-layouts:{index}", len(context) + 16)
        engine.runner.execute(ForwardBatch([chain_item(context, 0, table, blocks.block_size)]))
        tables.append(table)
    return tables


def _forward_seconds(engine: Engine, tables: list[list[int]], context_len: int, new: list[int]) -> float:
    block_size = engine.runner.block_size
    batch = ForwardBatch([chain_item(new, context_len, table, block_size, len(new)) for table in tables])
    start = time.perf_counter()
    engine.runner.execute(batch)
    return time.perf_counter() - start


@torch.inference_mode()
def measure(engines: dict[str, Engine], batch_size: int, context_len: int, new_tokens: list[int],
            vocab_size: int) -> list[dict]:
    generator = torch.Generator().manual_seed(context_len * 100 + batch_size)
    contexts = torch.randint(0, vocab_size, (batch_size, context_len + max(new_tokens)), generator=generator).tolist()
    tables = {name: _sequences(engine, [c[:context_len] for c in contexts]) for name, engine in engines.items()}
    seconds: dict[tuple[str, int], list[float]] = {}
    try:
        for _ in range(REPEATS):
            for n in new_tokens:
                for name, engine in engines.items():
                    elapsed = _forward_seconds(engine, tables[name], context_len, contexts[0][context_len:][:n])
                    seconds.setdefault((name, n), []).append(elapsed)
    finally:
        for engine in engines.values():
            for index in range(batch_size):
                engine.scheduler.blocks.free(f"cpu-layouts:{index}")
    rows = []
    for n in new_tokens:
        ms = {name: 1000 * statistics.median(seconds[(name, n)]) for name in engines}
        rows.append({"batch_size": batch_size, "context_len": context_len, "new_tokens": n,
                     "before_ms": round(ms["before"], 3), "now_ms": round(ms["now"], 3),
                     "now_over_before": round(ms["now"] / ms["before"], 3)})
    return rows


def run_cpu_layouts(args, config, tokenizer, out_dir: Path) -> dict:
    engines = _engines(config, args.compare)
    vocab_size = engines["now"].vocab_size
    new_tokens = [int(n) for n in args.new_tokens.split(",")]
    rows = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        for context_len in (int(c) for c in args.contexts.split(",")):
            if batch_size > 1 and context_len > args.max_batch_context:
                continue
            rows += measure(engines, batch_size, context_len, new_tokens, vocab_size)
            print(rows[-1], flush=True)
    now, before, _ = COMPARISONS[args.compare]
    results = {"benchmark": "cpu-layouts", "command": "specserve " + shlex.join(sys.argv[1:]), "compare": args.compare,
               "now": now, "before": before, "threads": torch.get_num_threads(), "repeats": REPEATS, "summary": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    return results


def markdown(results: dict) -> str:
    lines = [f"# Forward time by {results['compare']}: {results['now']} against {results['before']}, engines in turns",
             "", f"Command: `{results['command']}`", "",
             f"Milliseconds per forward, median of {results['repeats']} repeats, {results['threads']} threads.", "",
             f"| batch | context | new tokens per sequence | {results['before']} ms | {results['now']} ms | ratio |",
             "|---|---|---|---|---|---|"]
    for row in results["summary"]:
        lines.append(f"| {row['batch_size']} | {row['context_len']} | {row['new_tokens']} | {row['before_ms']} | "
                     f"{row['now_ms']} | {row['now_over_before']} |")
    return "\n".join(lines) + "\n"
