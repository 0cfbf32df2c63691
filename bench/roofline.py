"""`specserve bench roofline`: how close specserve's decoding step comes to the device's memory-bandwidth bound, what
verifying k drafted tokens costs beside one, and transformers' own best `generate` on the same model.

Llama-architecture models with random weights at real sizes (Llama 3.2 1B's and Llama 3.1 8B's shapes, bfloat16 on a
GPU) are built on the device, so nothing is downloaded. For each batch size B (1, 16, 64) every request holds CONTEXT
cached positions and the step is specserve's packed forward (engine/model/packed_runner.py: on a GPU the triton
backend over the paged pool, replaying CUDA graphs where a step fits them, engine/model/cuda_graphs.py) as the engine
runs it: the layout from the forward items, the forward, each logit row's argmax on the
device and the ids back on the host (greedy requests verify from those, `ForwardItem.choice`). Measured:
- `step_seconds`: that step with one new token per request (plain decoding), against `bound_seconds`, the bytes the
  step must read (every weight the step multiplies by once, the input embedding's rows aside, and every request's KV)
  over the device's copy bandwidth measured here (a large device-to-device copy, bytes read plus written);
- `verify{k}_over_1`: the step with k = 1, 4, 16, 64 new tokens per request (all rows' logits kept), over k = 1;
- `verify{k}_eager_seconds`, `verify{k}_sdpa_eager_seconds` (k = 1, 16): the same step without CUDA graphs, and
  with the SDPA backend (each step gathers the requests' keys and values into one padded copy) without them;
- `attention_seconds`: the plain decoding step's attention alone (the Triton kernel over every layer, replayed as one
  CUDA graph on a GPU so no launch is timed), against `attention_bound_seconds`, every request's KV over the copy
  bandwidth: no attention kernel (flash-attn's included) can take the step below `step_seconds` minus their
  difference;
- `verify{k}_host_logits_over_argmax`: the step when every row's float32 logits go to the host (what a request that
  samples, processes logits or asks for log-probabilities still needs) over the step that sends argmax ids;
- `hf_step_seconds`: transformers' `generate` with its static cache (compiled with torch.compile where the device is
  a GPU), per new token, from the difference of two generation lengths, so its prefill cancels out;
- `projected_copyspec_speedup`: what copy drafting would give at that batch size on this device, from the acceptance
  the CPU benchmark measured (bench/results/mt-redundant, copyspec's turn 2: tokens per forward and verified rows per
  forward) and this device's verify-cost curve: tokens per forward / (step(1 + drafted per forward) / step(1)).
Timings are medians of repeats after warm-up, each repeat synchronised with the device.
"""
from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.model.attention_layout import paged_rows
from engine.model.forward import ForwardBatch, RowChoice, chain_item
from engine.model.packed_runner import PackedModelRunner
from engine.model.paged_attention import PagedKVPool, kv_shape, resolve_attention_backend

SHAPES = {  # LlamaConfig fields of each size; "tiny" checks the benchmark itself on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
}
BATCH_SIZES = (1, 16, 64)
VERIFY_TOKENS = (1, 4, 16, 64)
CONTEXT = 512
BLOCK_SIZE = 16
MIN_REPEATS, MAX_REPEATS, REPEAT_SECONDS = 3, 20, 1.0
HF_TOKENS = (16, 48)  # the two generation lengths whose difference gives transformers' per-token time
COPY_BYTES = 1 << 30  # the bandwidth probe's buffer
CPU_MT_RESULTS = Path(__file__).resolve().parent / "results" / "mt-redundant" / "results.json"


def random_model(size: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A Llama of SIZE's shape with random weights (transformers' own initialisation), built on DEVICE."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # the benchmark's own models

    config = LlamaConfig(**SHAPES[size], max_position_embeddings=4096, rope_theta=500000.0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of the weights one step reads: every parameter once, except an input embedding the LM head does not
    share (a step reads only its requests' rows of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes_read(model: torch.nn.Module, batch_size: int, context: int, dtype: torch.dtype) -> int:
    layers, kv_heads, head_dim = kv_shape(model.config)
    return PagedKVPool.bytes_per_slot(layers, kv_heads, head_dim, dtype) * batch_size * context


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run, device: torch.device, warmup: int = 2) -> float:
    """Median wall time of RUN(), synchronised with DEVICE, over repeats until REPEAT_SECONDS (3 to 20 repeats)."""
    for _ in range(warmup):
        run()
    synchronize(device)
    times: list[float] = []
    while len(times) < MIN_REPEATS or (len(times) < MAX_REPEATS and sum(times) < REPEAT_SECONDS):
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    source = torch.randn(COPY_BYTES // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), device)
    return 2 * COPY_BYTES / seconds


class StepBench:
    """specserve's packed forward over B requests of CONTEXT cached positions each, in a pool of random KV: the
    runner the engine would build on this device (the triton backend and CUDA graphs on a GPU), and beside it the
    same runner eager, and the SDPA backend (keys gathered per step) eager."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, max_batch: int,
                 max_new: int, graph_max_tokens: int) -> None:
        layers, kv_heads, head_dim = kv_shape(model.config)
        self.blocks_per_request = -(-(CONTEXT + max_new) // BLOCK_SIZE)
        spare_block = max_batch * self.blocks_per_request  # the graphs' padding rows write here
        pool = PagedKVPool(layers, (spare_block + 1) * BLOCK_SIZE, kv_heads, head_dim, dtype, device)
        pool.keys.normal_()
        pool.values.normal_()
        backend = resolve_attention_backend("auto", device)
        self.runners = {"sdpa": PackedModelRunner(model, device, pool, BLOCK_SIZE, "sdpa")}
        self.runners["served"] = PackedModelRunner(model, device, pool, BLOCK_SIZE, backend)
        self.graphs = self.runners["served"].capture_graphs(spare_block, self.blocks_per_request, graph_max_tokens)
        self.device = device
        self.vocab = model.config.vocab_size
        self.pool, self.heads, self.head_dim = pool, model.config.num_attention_heads, head_dim

    def batch(self, batch_size: int, new_tokens: int, argmax_only: bool = True) -> ForwardBatch:
        """B chain items of NEW_TOKENS after CONTEXT cached positions, every row's logits asked for (only their
        argmax on the host where ARGMAX_ONLY)."""
        generator = torch.Generator().manual_seed(batch_size * 1000 + new_tokens)
        items = []
        for request in range(batch_size):
            first = request * self.blocks_per_request
            table = list(range(first, first + self.blocks_per_request))
            tokens = torch.randint(self.vocab, (new_tokens,), generator=generator).tolist()
            item = chain_item(tokens, CONTEXT, table, BLOCK_SIZE, num_logits=new_tokens)
            item.choice = RowChoice() if argmax_only else None
            items.append(item)
        return ForwardBatch(items)

    def seconds(self, batch_size: int, new_tokens: int, argmax_only: bool = True, runner: str = "served",
                eager: bool = False) -> float:
        """The median step; EAGER: the served runner with its graphs put aside."""
        batch, chosen = self.batch(batch_size, new_tokens, argmax_only), self.runners[runner]
        graphs = chosen.graphs
        chosen.graphs = None if eager else graphs
        try:
            return median_seconds(lambda: chosen.execute(batch), self.device)
        finally:
            chosen.graphs = graphs

    def attention_seconds(self, batch_size: int) -> float | None:
        """A plain decoding step's attention alone: the Triton kernel (engine/model/triton_attention.py) over every
        layer for B rows of CONTEXT cached positions, captured into one CUDA graph on a GPU and replayed, so only the
        kernels are timed; on a CPU only under Triton's interpreter (TRITON_INTERPRET=1, the tests), else None."""
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return None
        from engine.model.triton_attention import paged_rows_attention  # a GPU's kernel (or Triton's interpreter)

        items = self.batch(batch_size, 1).items
        rows = paged_rows(list(enumerate(items)), BLOCK_SIZE, self.device)
        query = torch.randn(batch_size, self.heads, self.head_dim, dtype=self.pool.keys.dtype, device=self.device)
        out = torch.empty_like(query)

        def attend_every_layer() -> None:
            for keys, values in zip(self.pool.layer_keys, self.pool.layer_values):
                paged_rows_attention(query, keys, values, rows, self.head_dim ** -0.5, None, out, BLOCK_SIZE)

        if self.device.type != "cuda":
            return median_seconds(attend_every_layer, self.device)
        attend_every_layer()  # compiles the kernels before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attend_every_layer()
        return median_seconds(graph.replay, self.device)


def hf_step_seconds(model: torch.nn.Module, device: torch.device, batch_size: int, compile_: bool) -> float:
    """transformers' `generate` per new token, greedy, static cache (compiled when COMPILE_): the difference of two
    generation lengths over the difference of their tokens, so the prefill cancels out."""
    from transformers import GenerationConfig  # the peer being measured

    generator = torch.Generator().manual_seed(batch_size)
    prompt = torch.randint(model.config.vocab_size, (batch_size, CONTEXT), generator=generator).to(device)
    max_len = CONTEXT + max(HF_TOKENS)

    def generate(new_tokens: int) -> None:
        config = GenerationConfig(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
            max_cache_len=max_len, disable_compile=not compile_, pad_token_id=0,
        )
        model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)

    long, short = (median_seconds(lambda n=n: generate(n), device, warmup=2) for n in reversed(HF_TOKENS))
    return (long - short) / (HF_TOKENS[1] - HF_TOKENS[0])


def copyspec_profile(mt_results: Path) -> dict | None:
    """Copy drafting's turn 2 on MT-Redundant as the CPU benchmark measured it: tokens per forward and verified rows
    per forward (1 + drafted tokens per forward), over every question of MT_RESULTS (bench/results/mt-redundant)."""
    if not mt_results.is_file():
        return None
    rows = [r for r in json.loads(mt_results.read_text())["rows"] if r["drafter"] == "copyspec" and r["turn"] == 2]
    forwards = sum(r["num_forwards"] for r in rows)
    if not forwards:
        return None
    return {"source": os.path.relpath(mt_results), "tokens_per_forward": sum(r["new_tokens"] for r in rows) / forwards,
            "rows_per_forward": 1 + sum(r["drafted_tokens"] for r in rows) / forwards}


def verify_cost(curve: dict[int, float], rows: float) -> float:
    """step(ROWS) / step(1) read off the measured curve {k: step(k) / step(1)}, linear between its points."""
    points = sorted(curve.items())
    for (k0, c0), (k1, c1) in zip(points, points[1:]):
        if rows <= k1:
            return c0 + (c1 - c0) * (rows - k0) / (k1 - k0)
    return points[-1][1]


def measure_size(size: str, args, device: torch.device, dtype: torch.dtype, bandwidth: float, profile) -> list[dict]:
    model = random_model(size, device, dtype)
    weights = weight_bytes_read(model)
    bench = StepBench(model, device, dtype, max(args.batch_sizes), max(args.verify_tokens), args.graph_max_tokens)
    rows = []
    for batch_size in args.batch_sizes:
        steps = {k: bench.seconds(batch_size, k) for k in args.verify_tokens}
        host = {k: bench.seconds(batch_size, k, argmax_only=False) for k in (1, 16) if k in steps}
        eager = {k: bench.seconds(batch_size, k, eager=True) for k in (1, 16) if k in steps} if bench.graphs else {}
        sdpa = {k: bench.seconds(batch_size, k, runner="sdpa") for k in (1, 16) if k in steps}
        kv_bytes = kv_bytes_read(model, batch_size, CONTEXT, dtype)
        bound = (weights + kv_bytes) / bandwidth
        curve = {k: steps[k] / steps[1] for k in steps}
        row = {"model_size": size, "batch_size": batch_size, "context": CONTEXT, "weight_bytes": weights,
               "step_seconds": steps[1], "bound_seconds": bound, "fraction_of_roofline": bound / steps[1],
               **{f"verify{k}_over_1": round(curve[k], 4) for k in steps},
               "attention_seconds": bench.attention_seconds(batch_size),
               "attention_bound_seconds": kv_bytes / bandwidth,
               **{f"verify{k}_host_logits_over_argmax": round(host[k] / steps[k], 4) for k in host},
               "backend": bench.runners["served"].backend, "cuda_graphs": bench.graphs,
               **{f"verify{k}_eager_seconds": eager[k] for k in eager},
               **{f"verify{k}_sdpa_eager_seconds": sdpa[k] for k in sdpa},
               "hf_step_seconds": None, "hf_over_specserve": None}
        if profile is not None:
            row["projected_copyspec_speedup"] = round(
                profile["tokens_per_forward"] / verify_cost(curve, profile["rows_per_forward"]), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    model.set_attn_implementation("sdpa")  # transformers' own attention again (the runner set specserve's)
    for row in rows:  # after specserve's rows: each compiles its own graphs, the slowest part of a run
        if row["batch_size"] in args.hf_batch_sizes:
            row["hf_step_seconds"] = hf_step_seconds(model, device, row["batch_size"], args.hf_compile)
            row["hf_over_specserve"] = row["hf_step_seconds"] / row["step_seconds"]
            print(json.dumps(row), flush=True)
    del model, bench
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def join_drafter_rows(out_dir: Path, mt_results: Path) -> dict:
    """OUT_DIR's results with the default model's rows per drafter from MT_RESULTS, an MT-Redundant run on the same
    device (turn 2, all categories), in place of any joined before."""
    results = json.loads((out_dir / "results.json").read_text())
    mt = json.loads(mt_results.read_text())
    results["summary"] = [r for r in results["summary"] if "model_size" in r] + drafter_rows(mt["summary"])
    results["default_model_command"] = mt["command"]
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "results.md").write_text(markdown(results))
    return results


def drafter_rows(summary: list[dict]) -> list[dict]:
    return [{"model": "default", "drafter": s["drafter"], "turn": s["turn"], "tokens_per_s": s["tokens_per_s"],
             "speedup_vs_none": s["speedup_vs_none"], "mean_acceptance_length": s["mean_acceptance_length"],
             "all_identical_to_baseline": s["all_identical_to_baseline"]}
            for s in summary if s["category"] == "all" and s["turn"] == 2]


def run_roofline(args, device_name: str, out_dir: Path) -> dict:
    """Measures every size of ARGS on DEVICE_NAME ("auto": a GPU where torch sees one); writes results.json,
    results.md and roofline.png under OUT_DIR. With ARGS.device_mt_results it measures nothing and joins that
    MT-Redundant run's rows into OUT_DIR's results instead."""
    if args.device_mt_results is not None:
        return join_drafter_rows(out_dir, args.device_mt_results)
    device = torch.device(device_name if device_name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.hf_compile = args.hf_compile and device.type == "cuda"
    out_dir.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth(device)
    results = {
        "benchmark": "roofline", "command": shlex.join(["specserve", "bench", "roofline", *sys.argv[3:]]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "copy_bandwidth_bytes_per_s": bandwidth,
        "context": CONTEXT, "copyspec_cpu_profile": copyspec_profile(args.cpu_mt_results), "summary": [],
    }
    for size in args.sizes:  # written after each size: a run cut short keeps what it measured
        results["summary"] += measure_size(size, args, device, dtype, bandwidth, results["copyspec_cpu_profile"])
        (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (out_dir / "results.md").write_text(markdown(results))
    plot(results["summary"], out_dir / "roofline.png")
    return results


def markdown(results: dict) -> str:
    lines = [f"# Roofline on {results['device']} ({results['dtype']}, torch {results['torch']})", "",
             f"`{results['command']}`", "",
             f"Copy bandwidth {results['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; every request holds "
             f"{results['context']} cached positions.", "",
             "| model | B | step ms | bound ms | of roofline | attention ms (its bound) | verify 4/16/64 over 1 | "
             "HF generate ms | projected copyspec × |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results["summary"]:
        if "model_size" not in r:
            continue
        hf = f"{r['hf_step_seconds'] * 1e3:.2f}" if r["hf_step_seconds"] else "—"
        verify = " / ".join(f"{r[f'verify{k}_over_1']:.2f}" for k in (4, 16, 64) if f"verify{k}_over_1" in r)
        attention = (f"{r['attention_seconds'] * 1e3:.3f} ({r['attention_bound_seconds'] * 1e3:.3f})"
                     if r.get("attention_seconds") else "—")
        lines.append(f"| {r['model_size']} | {r['batch_size']} | {r['step_seconds'] * 1e3:.2f} | "
                     f"{r['bound_seconds'] * 1e3:.2f} | {r['fraction_of_roofline']:.0%} | {attention} | {verify} | "
                     f"{hf} | {r.get('projected_copyspec_speedup', '—')} |")
    drafters = [r for r in results["summary"] if r.get("model") == "default"]
    if drafters:
        lines += ["", f"Default model, MT-Redundant turn 2 (`{results['default_model_command']}`):", "",
                  "| drafter | tok/s | × none | τ | identical |", "|---|---|---|---|---|"]
        lines += [f"| {r['drafter']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_none']} | "
                  f"{r['mean_acceptance_length']} | {r['all_identical_to_baseline']} |" for r in drafters]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # plots only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["model_size"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for size in sizes:
        mine = [r for r in rows if r["model_size"] == size]
        batches = [r["batch_size"] for r in mine]
        axes[0].plot(batches, [r["step_seconds"] * 1e3 for r in mine], "o-", label=f"{size} specserve")
        axes[0].plot(batches, [r["bound_seconds"] * 1e3 for r in mine], "k--", alpha=0.5, label=f"{size} bound")
        for r in mine:
            ks = [k for k in VERIFY_TOKENS if f"verify{k}_over_1" in r]
            axes[1].plot(ks, [r[f"verify{k}_over_1"] for k in ks], "o-", label=f"{size} B={r['batch_size']}")
    axes[0].set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode step (ms)")
    axes[1].set(xscale="log", xlabel="tokens verified per request (k)", ylabel="step(k) / step(1)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
