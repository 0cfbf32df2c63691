"""The SPECTRA benchmark, on the paper's sets (MT-Bench turn 1, HumanEval, GSM8K), single stream, greedy, in-process
engines (drafters/spectra.py).

- headline: `none`, `copyspec`, `ngram`, `spectra-core` and `spectra` (its retrieval indexes: the traffic and the
  calibrated corpus) with the goodput planner on (what users get), `spectra`
  without its candidate pool (its dictionaries fed by the target's tokens alone), and `spectra` with the planner off
  (every guess verified and every pool chain carried each step: the paper's setting, for its tokens per call). Every
  question is answered by each variant in turn, in an order rotated from question to question, so that the ratios
  compare runs seconds apart. The look-ahead rows the planner let the pool add are reported per call.
- ablation: `spectra` with the planner off over the pool size W and the refine threshold tau, on the first few
  questions of each set, for tokens per call.
- agentic (`--agentic N`): N requests from separate conversations whose answers share one JSON schema
  (bench/agentic.py), one after another, for `none`, `copyspec`, `spectra-core` and `spectra` (its traffic index on),
  planner on: what the index of earlier responses adds.

Every output is compared with `none`'s (near-tie rule, bench/exactness.py). Results: results.json (rows and a
`summary` per phase, dataset and variant) and results.md.
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

from bench.agentic import agentic_prompts
from bench.exactness import divergence_verdict
from bench.ngram import DATASETS, first_turn_prompts
from bench.runners import EngineRunner
from drafters.config import SpecConfig
from engine.engine import Engine

ABLATION_POOLS = (0, 5, 15)
ABLATION_TAUS = (0.0, 0.1, 0.5, 1.0)


@dataclass(frozen=True)
class Variant:
    drafter: str
    planner: bool = True
    pool: int | None = None  # spectra: chains in the candidate pool (default: the config's)
    tau: float | None = None

    @property
    def label(self) -> str:
        if self.drafter != "spectra":
            return self.drafter
        pool = "" if self.pool is None else f" W={self.pool}"
        tau = "" if self.tau is None else f" tau={self.tau:g}"
        return f"spectra{pool}{tau} planner {'on' if self.planner else 'off'}"


HEADLINE = (Variant("none"), Variant("copyspec"), Variant("ngram"), Variant("spectra-core"), Variant("spectra", pool=0),
            Variant("spectra"), Variant("spectra", planner=False))
AGENTIC = (Variant("none"), Variant("copyspec"), Variant("spectra-core"), Variant("spectra"))


def make_runner(variant: Variant, config) -> EngineRunner:
    spec: SpecConfig = config.with_drafter(variant.drafter).spec
    spec = replace(spec, spectra_pool=spec.spectra_pool if variant.pool is None else variant.pool,
                   spectra_tau=spec.spectra_tau if variant.tau is None else variant.tau)
    config = replace(config, spec=spec, scheduler=replace(config.scheduler, use_goodput_planner=variant.planner))
    runner = EngineRunner(Engine(config))
    if variant.drafter == "ngram" and runner.engine.speculation.drafter.bigram.wait() is None:
        raise RuntimeError("the model bigram table could not be built")
    return runner


def row(phase: str, dataset: str, question: dict, variant: Variant, gen, verdict: str) -> dict:
    return {
        "phase": phase, "dataset": dataset, "question_id": question["question_id"], "variant": variant.label,
        "drafter": variant.drafter, "planner": variant.planner, "pool": variant.pool, "tau": variant.tau,
        "new_tokens": len(gen.token_ids), "seconds": round(gen.seconds, 4), "num_forwards": gen.num_forwards,
        "num_drafts": gen.num_drafts, "drafted_tokens": gen.drafted_tokens, "accepted_tokens": gen.accepted_tokens,
        "lookahead_rows": gen.lookahead_rows, "identical_to_baseline": verdict == "identical", "exactness": verdict,
    }


def run_phase(phase: str, prompts: dict, runners: dict, reference_model, max_tokens: int) -> list[dict]:
    """Each question by every runner, rotating the order; `none` (the first runner) is every output's reference."""
    rows = []
    variants = list(runners)
    items = [(dataset, q, prompt) for dataset, pairs in prompts.items() for q, prompt in pairs]
    for i, (dataset, question, prompt) in enumerate(tqdm(items, desc=phase)):
        order = variants[i % len(variants):] + variants[:i % len(variants)]
        generations = {variant: runners[variant].generate(prompt, max_tokens) for variant in order}
        baseline = generations[variants[0]].token_ids
        for variant in variants:
            verdict = divergence_verdict(reference_model, prompt, baseline, generations[variant].token_ids)
            rows.append(row(phase, dataset, question, variant, generations[variant], verdict))
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["phase"], r["dataset"], r["variant"])].append(r)
    summary = [summary_entry(key, group) for key, group in groups.items()]
    none_speed = {(s["phase"], s["dataset"]): s["tokens_per_s"] for s in summary if s["variant"] == "none"}
    for s in summary:
        base = none_speed.get((s["phase"], s["dataset"]))
        s["speedup_vs_none"] = round(s["tokens_per_s"] / base, 3) if base else None
    return summary


def summary_entry(key: tuple, group: list[dict]) -> dict:
    phase, dataset, variant = key
    new_tokens, seconds = sum(r["new_tokens"] for r in group), sum(r["seconds"] for r in group)
    num_drafts, accepted = sum(r["num_drafts"] for r in group), sum(r["accepted_tokens"] for r in group)
    forwards = sum(r["num_forwards"] for r in group)
    return {
        "phase": phase, "dataset": dataset, "variant": variant, "num_questions": len(group),
        "tokens_per_call": round(new_tokens / forwards, 3), "tokens_per_s": round(new_tokens / seconds, 3),
        "mean_acceptance_length": round(1 + accepted / num_drafts, 3) if num_drafts else 1.0,
        "lookahead_rows_per_call": round(sum(r["lookahead_rows"] for r in group) / forwards, 2),
        "drafted_tokens": sum(r["drafted_tokens"] for r in group), "accepted_tokens": accepted,
        "all_identical_to_baseline": all(r["exactness"] != "mismatch" for r in group),
        "num_near_ties": sum(r["exactness"] == "near-tie" for r in group),
    }


def markdown(results: dict) -> str:
    setup = results["setup"]
    lines = [f"# SPECTRA: {', '.join(DATASETS)} (turn 1), greedy, single stream", "",
             f"Command: `{results['command']}`", ""]
    for phase, title in (("headline", f"Headline: first {setup['headline_questions']} questions of each set, "
                                      f"{setup['max_tokens']} new tokens; speedup over `none` in the same run."),
                         ("ablation", f"Ablation (planner off, first {setup['ablation_questions']} questions): "
                                      "the pool size W and the refine threshold tau."),
                         ("agentic", f"Agentic: {setup['agentic_requests']} requests from separate conversations, "
                                     "one JSON schema, one after another, planner on (bench/agentic.py).")):
        entries = [s for s in results["summary"] if s["phase"] == phase]
        if not entries:
            continue
        lines += [title, "", "| dataset | variant | tokens/call | tokens/s | ×none | τ | look-ahead rows/call |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {s['dataset']} | {s['variant']} | {s['tokens_per_call']:.2f} | {s['tokens_per_s']:.1f} | "
                  f"{s['speedup_vs_none']:.2f} | {s['mean_acceptance_length']:.2f} | {s['lookahead_rows_per_call']} |"
                  for s in entries]
        lines.append("")
    mismatches = sum(r["exactness"] == "mismatch" for r in results["rows"])
    lines.append(f"Exactness: {mismatches} outputs differ from `none` beyond a near-tie, over "
                 f"{len(results['rows'])} generations.")
    return "\n".join(lines) + "\n"


def write_results(rows: list[dict], setup: dict, out_dir: Path) -> dict:
    results = {
        "benchmark": "spectra", "command": "specserve " + shlex.join(sys.argv[1:]),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "setup": setup,
        "summary": summarize(rows), "rows": rows,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    return results


def run_spectra_benchmark(args, config, tokenizer, out_dir: Path) -> dict:
    """The headline, the ablation and the agentic run, each phase's engines freed before the next one's start."""
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = {"headline_questions": args.limit if args.limit is not None else 10, "max_tokens": args.max_new_tokens,
             "ablation_questions": args.grid_limit, "datasets": list(DATASETS),
             "ablation_pools": list(ABLATION_POOLS), "ablation_taus": list(ABLATION_TAUS),
             "agentic_requests": args.agentic}
    rows: list[dict] = []
    if setup["headline_questions"]:
        rows += run_headline_and_ablation(args, config, tokenizer, setup, out_dir)
        gc.collect()
    if args.agentic:
        rows += run_agentic(args, config, tokenizer)
    return write_results(rows, setup, out_dir)


def run_headline_and_ablation(args, config, tokenizer, setup: dict, out_dir: Path) -> list[dict]:
    prompts = {d: first_turn_prompts(tokenizer, d, setup["headline_questions"], args.data_dir) for d in DATASETS}
    runners = {variant: make_runner(variant, config) for variant in HEADLINE}
    reference_model = runners[Variant("none")].engine.runner.model
    for runner in runners.values():  # one-off costs stay out of the measurements
        runner.generate(prompts[DATASETS[0]][0][1], 8)
    rows = run_phase("headline", prompts, runners, reference_model, args.max_new_tokens)
    write_results(rows, setup, out_dir)
    if args.grid_limit:
        none = runners[Variant("none")]
        runners.clear()
        gc.collect()
        ablation = {Variant("none"): none}
        ablation.update({Variant("spectra", False, pool, 0.1): make_runner(Variant("spectra", False, pool, 0.1), config)
                         for pool in ABLATION_POOLS})
        ablation.update({Variant("spectra", False, 15, tau): make_runner(Variant("spectra", False, 15, tau), config)
                         for tau in ABLATION_TAUS if tau != 0.1})
        few = {d: pairs[:args.grid_limit] for d, pairs in prompts.items()}
        rows += run_phase("ablation", few, ablation, reference_model, args.max_new_tokens)
    return rows


def run_agentic(args, config, tokenizer) -> list[dict]:
    """The agentic phase, in engines of its own (a fresh traffic index): each variant warmed on an unrelated
    prompt first."""
    prompts = agentic_prompts(tokenizer, args.agentic)
    runners = {variant: make_runner(variant, config) for variant in AGENTIC}
    warm = first_turn_prompts(tokenizer, DATASETS[0], 1, args.data_dir)[0][1]
    for runner in runners.values():
        runner.generate(warm, 8)
    rows = run_phase("agentic", {"agentic": prompts}, runners, runners[Variant("none")].engine.runner.model,
                     args.max_new_tokens)
    runners.clear()
    gc.collect()
    return rows
