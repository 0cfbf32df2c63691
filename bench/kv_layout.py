"""`specserve bench kv-layout`: forward time against context length for the CPU's two KV pool layouts.

The pool is `[layers, slots, kv_heads, head_dim]` by shape everywhere; on the CPU its memory lies head by head
(engine/model/paged_attention.py PagedKVPool), on CUDA slot by slot. Two engines on the served model, one with each
layout (the slot-major one made with the pool's layout patched, here only), take turns forward by forward: for each
batch size B and context length C, B sequences of C distinct tokens are prefilled, then each engine runs forwards of
N new tokens per sequence (a decode step at N = 1, a verify step of N - 1 drafted tokens above it), REPEATS times in
turn. The attention kernel computes the same bits from either layout (tests/engine/model/test_decoder.py); what
differs is how its reads stream. Each figure is the median over the repeats.
"""
from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

import engine.model.paged_attention as paged_attention
from engine.engine import Engine
from engine.model.forward import ForwardBatch, chain_item

REPEATS = 20
LAYOUTS = ("slot-major", "head-major")


def add_kv_layout_flags(parser) -> None:
    parser.add_argument("--contexts", default="64,256,512,1024,2048", help="context lengths, comma-separated")
    parser.add_argument("--batch-sizes", default="1,16", help="sequences per forward, comma-separated")
    parser.add_argument("--new-tokens", default="1,2,4", help="new tokens per sequence per forward, comma-separated")
    parser.add_argument("--max-batch-context", type=int, default=1024,
                        help="contexts above this are measured at batch 1 only (their prefill at batch 16 is long)")


def _slot_major_pool(num_layers, num_slots, num_kv_heads, head_dim, dtype, device) -> torch.Tensor:
    return paged_attention._zeros((num_layers, num_slots, num_kv_heads, head_dim), dtype, device)


def _engines(config) -> dict[str, Engine]:
    with mock.patch.object(paged_attention, "_pool_tensor", _slot_major_pool):
        slot_major = Engine(config)
    return {"slot-major": slot_major, "head-major": Engine(config)}


def _sequences(engine: Engine, contexts: list[list[int]]) -> list[list[int]]:
    """Prefills each context as a sequence of its own -> their block tables (room for 16 more tokens each)."""
    blocks, tables = engine.scheduler.blocks, []
    for index, context in enumerate(contexts):
        table = blocks.grow(f"kv-layout:{index}", len(context) + 16)
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
                engine.scheduler.blocks.free(f"kv-layout:{index}")
    rows = []
    for n in new_tokens:
        ms = {name: 1000 * statistics.median(seconds[(name, n)]) for name in engines}
        rows.append({"batch_size": batch_size, "context_len": context_len, "new_tokens": n,
                     "slot_major_ms": round(ms["slot-major"], 3), "head_major_ms": round(ms["head-major"], 3),
                     "head_over_slot": round(ms["head-major"] / ms["slot-major"], 3)})
    return rows


def run_kv_layout(args, config, tokenizer, out_dir: Path) -> dict:
    engines = _engines(config)
    vocab_size = engines["head-major"].vocab_size
    new_tokens = [int(n) for n in args.new_tokens.split(",")]
    rows = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        for context_len in (int(c) for c in args.contexts.split(",")):
            if batch_size > 1 and context_len > args.max_batch_context:
                continue
            rows += measure(engines, batch_size, context_len, new_tokens, vocab_size)
            print(rows[-1], flush=True)
    results = {"benchmark": "kv-layout", "command": "specserve " + shlex.join(sys.argv[1:]),
               "threads": torch.get_num_threads(), "repeats": REPEATS, "summary": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    return results


def markdown(results: dict) -> str:
    lines = ["# Forward time by KV pool layout, engines in turns", "", f"Command: `{results['command']}`", "",
             f"Milliseconds per forward, median of {results['repeats']} repeats, {results['threads']} threads.", "",
             "| batch | context | new tokens per sequence | slot-major ms | head-major ms | head ÷ slot |",
             "|---|---|---|---|---|---|"]
    for row in results["summary"]:
        lines.append(f"| {row['batch_size']} | {row['context_len']} | {row['new_tokens']} | {row['slot_major_ms']} | "
                     f"{row['head_major_ms']} | {row['head_over_slot']} |")
    return "\n".join(lines) + "\n"
