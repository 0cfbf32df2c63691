"""The learning-free n-gram benchmark, on the paper's three sets (MT-Bench turn 1, HumanEval, GSM8K), single
stream, greedy, in-process engines.

- headline: `none`, `copyspec` and `ngram` at (k, w) = (10, 10) with the goodput planner off (every drafted
  token verified: the paper's tokens per call) and on (what users get). Every question is answered by all the
  variants at once, their engines taking turns a step at a time, so that the ratios compare steps milliseconds apart.
- grid: `ngram` over k x w with the planner off, on the first few questions of each set, for tokens per call.

Every output is compared with `none`'s (near-tie rule, bench/exactness.py). Results: results.json (rows and a
`summary` with one entry per phase, dataset, drafter, k, w and planner), results.md, and a heat map of tokens
per call over k x w per dataset.
"""
from __future__ import annotations

import gc
import json
import shlex
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from bench.data import load_questions
from bench.exactness import divergence_verdict
from bench.mt import render_prompt
from bench.runners import EngineRunner, generate_together
from engine.engine import Engine

DATASETS = ("mt-bench", "humaneval", "gsm8k")
GRID_K = (1, 5, 10, 25)
GRID_W = (2, 4, 10)
HEADLINE_KW = (10, 10)


@dataclass(frozen=True)
class Variant:
    drafter: str
    k: int | None = None
    w: int | None = None
    planner: bool = True

    @property
    def label(self) -> str:
        if self.drafter != "ngram":
            return self.drafter
        return f"ngram({self.k},{self.w}) planner {'on' if self.planner else 'off'}"


HEADLINE = (Variant("none"), Variant("copyspec"), Variant("ngram", *HEADLINE_KW, False),
            Variant("ngram", *HEADLINE_KW, True))


def first_turn_prompts(tokenizer, dataset: str, limit: int, data_dir: Path | None) -> list[tuple[dict, list[int]]]:
    questions = load_questions(dataset, data_dir)[:limit]
    return [(q, render_prompt(tokenizer, [{"role": "user", "content": q["turns"][0]}])) for q in questions]


def make_runner(variant: Variant, args, config):
    config = config.with_drafter(variant.drafter)
    spec = replace(config.spec, ngram_k=variant.k or config.spec.ngram_k, ngram_w=variant.w or config.spec.ngram_w)
    config = replace(config, spec=spec, scheduler=replace(config.scheduler, use_goodput_planner=variant.planner))
    runner = EngineRunner(Engine(config))
    drafter = runner.engine.speculation.drafter
    if variant.drafter == "ngram" and drafter.bigram.wait() is None:
        raise RuntimeError("the model bigram table could not be built")
    return runner


def row(phase: str, dataset: str, question: dict, variant: Variant, gen, verdict: str) -> dict:
    return {
        "phase": phase, "dataset": dataset, "question_id": question["question_id"], "drafter": variant.drafter,
        "k": variant.k, "w": variant.w, "planner": variant.planner, "new_tokens": len(gen.token_ids),
        "seconds": round(gen.seconds, 4), "num_forwards": gen.num_forwards, "num_drafts": gen.num_drafts,
        "drafted_tokens": gen.drafted_tokens, "accepted_tokens": gen.accepted_tokens,
        "identical_to_baseline": verdict == "identical", "exactness": verdict,
    }


def run_headline(prompts: dict, runners: dict, reference_model, max_tokens: int) -> tuple[list[dict], dict]:
    """Each question by every variant, their steps taken in turns (bench/runners.py's generate_together); returns
    rows and none's outputs by (dataset, question)."""
    rows, baselines = [], {}
    items = [(dataset, q, prompt) for dataset, pairs in prompts.items() for q, prompt in pairs]
    for dataset, question, prompt in tqdm(items, desc="headline"):
        generations = generate_together({variant: runners[variant] for variant in HEADLINE}, prompt, max_tokens)
        baseline = generations[Variant("none")].token_ids
        baselines[(dataset, question["question_id"])] = baseline
        for variant in HEADLINE:
            verdict = divergence_verdict(reference_model, prompt, baseline, generations[variant].token_ids)
            rows.append(row("headline", dataset, question, variant, generations[variant], verdict))
    return rows, baselines


def run_grid(prompts: dict, none_runner, args, config, reference_model, max_tokens: int) -> list[dict]:
    """ngram over k x w, planner off, one engine at a time; none's outputs at the same length are the reference."""
    rows = []
    baselines = {(d, q["question_id"]): none_runner.generate(p, max_tokens)
                 for d, pairs in prompts.items() for q, p in pairs}
    for (dataset, question_id), gen in baselines.items():
        question = next(q for q, _ in prompts[dataset] if q["question_id"] == question_id)
        rows.append(row("grid", dataset, question, Variant("none"), gen, "identical"))
    for k in GRID_K:
        for w in GRID_W:
            variant = Variant("ngram", k, w, False)
            runner = make_runner(variant, args, config)
            for dataset, pairs in prompts.items():
                for question, prompt in pairs:
                    gen = runner.generate(prompt, max_tokens)
                    reference = baselines[(dataset, question["question_id"])].token_ids
                    rows.append(row("grid", dataset, question, variant, gen,
                                    divergence_verdict(reference_model, prompt, reference, gen.token_ids)))
            del runner
            gc.collect()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["phase"], r["dataset"], r["drafter"], r["k"], r["w"], r["planner"])].append(r)
    summary = [summary_entry(key, group) for key, group in groups.items()]
    none_speed = {(s["phase"], s["dataset"]): s["tokens_per_s"] for s in summary if s["drafter"] == "none"}
    for s in summary:
        base = none_speed.get((s["phase"], s["dataset"]))
        s["speedup_vs_none"] = round(s["tokens_per_s"] / base, 3) if base else None
    return summary


def summary_entry(key: tuple, group: list[dict]) -> dict:
    phase, dataset, drafter, k, w, planner = key
    new_tokens, seconds = sum(r["new_tokens"] for r in group), sum(r["seconds"] for r in group)
    num_drafts, accepted = sum(r["num_drafts"] for r in group), sum(r["accepted_tokens"] for r in group)
    return {
        "phase": phase, "dataset": dataset, "drafter": drafter, "k": k, "w": w, "planner": planner,
        "num_questions": len(group),
        "tokens_per_call": round(new_tokens / sum(r["num_forwards"] for r in group), 3),
        "tokens_per_s": round(new_tokens / seconds, 3),
        "mean_acceptance_length": round(1 + accepted / num_drafts, 3) if num_drafts else 1.0,
        "drafted_tokens": sum(r["drafted_tokens"] for r in group), "accepted_tokens": accepted,
        "all_identical_to_baseline": all(r["exactness"] != "mismatch" for r in group),
        "num_near_ties": sum(r["exactness"] == "near-tie" for r in group),
    }


def markdown(results: dict) -> str:
    lines = [
        f"# Learning-free n-grams: {', '.join(DATASETS)} (turn 1), greedy, single stream", "",
        f"Command: `{results['command']}`", "",
        f"Headline: first {results['setup']['headline_questions']} questions of each set, "
        f"{results['setup']['headline_max_tokens']} new tokens; speedup over `none` in the same run.", "",
        "| dataset | drafter | planner | tokens/call | tokens/s | ×none | τ | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in (s for s in results["summary"] if s["phase"] == "headline"):
        name = s["drafter"] + (f" ({s['k']},{s['w']})" if s["k"] else "")
        planner = "–" if s["drafter"] == "none" else ("on" if s["planner"] else "off")
        lines.append(f"| {s['dataset']} | {name} | {planner} | {s['tokens_per_call']:.2f} | {s['tokens_per_s']:.1f} | "
                     f"{s['speedup_vs_none']:.2f} | {s['mean_acceptance_length']:.2f} | "
                     f"{s['all_identical_to_baseline']} |")
    lines += [""] + (_grid_lines(results) if results["setup"]["grid_questions"] else [])
    mismatches = sum(r["exactness"] == "mismatch" for r in results["rows"])
    lines.append(f"Exactness: {mismatches} outputs differ from `none` beyond a near-tie, over "
                 f"{len(results['rows'])} generations.")
    return "\n".join(lines) + "\n"


def _grid_lines(results: dict) -> list[str]:
    lines = [f"Grid (planner off, first {results['setup']['grid_questions']} questions, "
             f"{results['setup']['grid_max_tokens']} new tokens): tokens per call", ""]
    for dataset in DATASETS:
        lines += [f"**{dataset}**", "", "| k \\ w | " + " | ".join(map(str, GRID_W)) + " |",
                  "|---" * (len(GRID_W) + 1) + "|"]
        cells = {(s["k"], s["w"]): s for s in results["summary"]
                 if s["phase"] == "grid" and s["dataset"] == dataset and s["k"]}
        for k in GRID_K:
            lines.append(f"| {k} | " + " | ".join(_grid_cell(cells.get((k, w))) for w in GRID_W) + " |")
        lines.append("")
    return lines


def _grid_cell(entry: dict | None) -> str:
    return "–" if entry is None else f"{entry['tokens_per_call']:.2f}"


def plot_grids(summary: list[dict], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for dataset in DATASETS:
        cells = {(s["k"], s["w"]): s["tokens_per_call"] for s in summary
                 if s["phase"] == "grid" and s["dataset"] == dataset and s["k"]}
        if not cells:
            continue
        values = [[cells.get((k, w), float("nan")) for w in GRID_W] for k in GRID_K]
        fig, ax = plt.subplots(figsize=(4.5, 4))
        image = ax.imshow(values, cmap="viridis", origin="lower")
        ax.set_xticks(range(len(GRID_W)), GRID_W)
        ax.set_yticks(range(len(GRID_K)), GRID_K)
        ax.set_xlabel("w (tokens per row)")
        ax.set_ylabel("k (rows)")
        for i, k_values in enumerate(values):
            for j, value in enumerate(k_values):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white")
        ax.set_title(f"{dataset}: tokens per call")
        fig.colorbar(image)
        fig.tight_layout()
        fig.savefig(out_dir / f"grid_{dataset}.png", dpi=100)
        plt.close(fig)


def write_results(rows: list[dict], setup: dict, out_dir: Path) -> dict:
    results = {
        "benchmark": "ngram",
        "command": "specserve " + shlex.join(sys.argv[1:]),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "setup": setup,
        "summary": summarize(rows),
        "rows": rows,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    plot_grids(results["summary"], out_dir)
    return results


def run_ngram_benchmark(args, config, tokenizer, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = {"headline_questions": args.limit or 20, "headline_max_tokens": args.max_new_tokens,
             "grid_questions": args.grid_limit, "grid_max_tokens": args.grid_max_new_tokens,
             "datasets": list(DATASETS), "grid_k": list(GRID_K), "grid_w": list(GRID_W)}
    headline_prompts = {d: first_turn_prompts(tokenizer, d, setup["headline_questions"], args.data_dir)
                        for d in DATASETS}
    runners = {variant: make_runner(variant, args, config) for variant in HEADLINE}
    reference_model = runners[Variant("none")].engine.runner.model
    for runner in runners.values():  # one-off costs stay out of the measurements
        runner.generate(headline_prompts[DATASETS[0]][0][1], 8)
    rows, _ = run_headline(headline_prompts, runners, reference_model, args.max_new_tokens)
    write_results(rows, setup, out_dir)
    none_runner = runners.pop(Variant("none"))
    runners.clear()
    gc.collect()
    if args.grid_limit:
        grid_prompts = {d: pairs[:args.grid_limit] for d, pairs in headline_prompts.items()}
        rows += run_grid(grid_prompts, none_runner, args, config, reference_model, args.grid_max_new_tokens)
    return write_results(rows, setup, out_dir)
