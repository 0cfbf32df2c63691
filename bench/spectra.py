"""The SPECTRA benchmark, on the paper's sets (MT-Bench turn 1, HumanEval, GSM8K), single stream, greedy or sampled
(`--temperature`), in-process engines (drafters/spectra.py).

- headline (`--limit` questions of each set): `none`, `copyspec`, `ngram`, `spectra-core` and `spectra` (its
  retrieval indexes: the traffic and the calibrated corpus) with the goodput planner on, what users get; with
  `--draft-model`, `draft` too (the draft model alone). The look-ahead rows the planner let the pool add are
  reported per call.
- planner-off (`--planner-off-limit`): `ngram` and `spectra` with every guess verified and every pool chain carried
  each step, the paper's setting, for its tokens per call (a step then carries ~60 look-ahead rows: slow here);
  with `--draft-model`, `draft` drafting `--num-draft-tokens` every step.
- ablation (`--grid-limit`, the paper's Table 2): `spectra` with the planner on, whole and without each component:
  drafting without the forward dictionary, without the backward one, without retrieval (both indexes and the model
  n-grams), without the model n-grams alone (drafters/model_ngrams.py), and with a corpus index that holds every
  sample unfiltered (the calibration prompts' answers and the code, unscored) in place of the perplexity-filtered
  one.
Every question of a phase is answered by all its variants at once, their engines taking turns a step at a time
(bench/runners.py's generate_together), so that the ratios compare steps milliseconds apart.
- agentic (`--agentic N`): N requests from separate conversations whose answers repeat each other although no prompt
  holds them (bench/agentic.py), one after another, for `none`, `copyspec`, `spectra-core`, `spectra` without its
  traffic index (the corpus kept) and `spectra`, planner on, the session cache off (each request its own
  conversation): what the index of earlier responses adds.

Greedy outputs are compared with `none`'s (near-tie rule, bench/exactness.py); sampled ones (temperature > 0, each
request seeded by its prompt) are not: tests/engine/test_sampling_distribution.py checks their
distribution. Results: results.json (rows and a `summary` per phase, dataset and variant) and results.md.
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
from bench.runners import EngineRunner, acceptance_by_depth, generate_together, summed
from drafters.retrieval import BYTES_PER_TOKEN, SuffixIndex
from engine.artifacts import corpus_path, weights_fingerprint
from engine.calibration.corpus import corpus_samples
from engine.calibration.options import CalibrationOptions
from engine.drafter_context import model_cache_dir
from engine.engine import Engine
from engine.model.draft_model import MODEL_DRAFTERS

# Variant.without: what the ablation takes away
ABLATED = ("forward", "backward", "retrieval", "model-ngrams", "filter")
TRAFFIC = "traffic"  # Variant.without: the traffic index alone (the agentic phase's comparison)


@dataclass(frozen=True)
class Variant:
    drafter: str
    planner: bool = True
    without: str | None = None  # spectra: one of ABLATED, or TRAFFIC

    @property
    def label(self) -> str:
        if self.drafter == "spectra":
            without = {None: "", "filter": " unfiltered corpus"}.get(self.without, f" without {self.without}")
            return f"spectra{without} planner {'on' if self.planner else 'off'}"
        return self.drafter if self.planner else f"{self.drafter} planner off"


HEADLINE = (Variant("none"), Variant("copyspec"), Variant("ngram"), Variant("spectra-core"), Variant("spectra"))
PLANNER_OFF = (Variant("none"), Variant("ngram", planner=False), Variant("spectra", planner=False))
ABLATION = (Variant("none"), Variant("spectra"), *(Variant("spectra", without=part) for part in ABLATED))
AGENTIC = (Variant("none"), Variant("copyspec"), Variant("spectra-core"), Variant("spectra", without=TRAFFIC),
           Variant("spectra"))


def with_draft_variants(variants: tuple[Variant, ...], config) -> tuple[Variant, ...]:
    """VARIANTS, and `draft` with the same planner setting as the last of them when a draft model is given."""
    if not config.model.draft_model:
        return variants
    return (*variants, Variant("draft", planner=variants[-1].planner))


def make_runner(variant: Variant, config, temperature: float, unfiltered: SuffixIndex | None = None) -> EngineRunner:
    draft = config.model.draft_model if variant.drafter in MODEL_DRAFTERS else None
    config = replace(config.with_drafter(variant.drafter), model=replace(config.model, draft_model=draft),
                     scheduler=replace(config.scheduler, use_goodput_planner=variant.planner))
    runner = EngineRunner(Engine(config), temperature)
    ablate(runner.engine.speculation.drafter, variant.without, unfiltered)
    return runner


def ablate(drafter, without: str | None, unfiltered: SuffixIndex | None) -> None:
    """Take WITHOUT away from a SPECTRA drafter: a dictionary's guesses, retrieval (both indexes and the model
    n-grams), the model n-grams alone, the traffic index alone, or the filtered corpus (replaced by UNFILTERED)."""
    if without in ("forward", "backward"):
        drafter.dictionaries = drafter.dictionaries - {without}
    elif without == "retrieval":
        drafter.traffic = drafter.corpus = drafter.model_ngrams = None
    elif without == "model-ngrams":
        drafter.model_ngrams = None
    elif without == TRAFFIC:
        drafter.traffic = None
    elif without == "filter":
        if drafter.corpus is None:
            raise RuntimeError("the filter's ablation needs the filtered corpus: run `specserve calibrate corpus`")
        drafter.corpus = unfiltered


def unfiltered_corpus(runner: EngineRunner, tokenizer) -> SuffixIndex:
    """An index over every sample `specserve calibrate corpus` draws from, none scored or left out."""
    samples = corpus_samples(runner.engine, tokenizer, CalibrationOptions().max_new_tokens)
    index = SuffixIndex(sum(BYTES_PER_TOKEN * len(sample.token_ids) for sample in samples))
    for sample in samples:
        index.add(sample.token_ids)
    return index


def row(phase: str, dataset: str, question: dict, variant: Variant, gen, verdict: str) -> dict:
    return {
        "phase": phase, "dataset": dataset, "question_id": question["question_id"], "variant": variant.label,
        "drafter": variant.drafter, "planner": variant.planner, "without": variant.without,
        "new_tokens": len(gen.token_ids), "seconds": round(gen.seconds, 4), "num_forwards": gen.num_forwards,
        "num_drafts": gen.num_drafts, "drafted_tokens": gen.drafted_tokens, "accepted_tokens": gen.accepted_tokens,
        "lookahead_rows": gen.lookahead_rows, "accepted_per_position": gen.accepted_per_position,
        "identical_to_baseline": verdict == "identical", "exactness": verdict,
    }


def run_phase(phase: str, prompts: dict, runners: dict, reference_model, max_tokens: int) -> list[dict]:
    """Each question by every runner, their steps taken in turns (bench/runners.py's generate_together); `none` (the
    first runner) is every greedy output's reference."""
    rows = []
    variants = list(runners)
    items = [(dataset, q, prompt) for dataset, pairs in prompts.items() for q, prompt in pairs]
    for dataset, question, prompt in tqdm(items, desc=phase):
        generations = generate_together(runners, prompt, max_tokens)
        baseline = generations[variants[0]].token_ids
        for variant in variants:
            verdict = "sampled" if runners[variant].temperature else \
                divergence_verdict(reference_model, prompt, baseline, generations[variant].token_ids)
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
        "acceptance_by_depth": acceptance_by_depth(summed([r["accepted_per_position"] for r in group]), num_drafts),
        "lookahead_rows_per_call": round(sum(r["lookahead_rows"] for r in group) / forwards, 2),
        "drafted_tokens": sum(r["drafted_tokens"] for r in group), "accepted_tokens": accepted,
        "all_identical_to_baseline": None if any(r["exactness"] == "sampled" for r in group)
        else all(r["exactness"] != "mismatch" for r in group),
        "num_near_ties": sum(r["exactness"] == "near-tie" for r in group),
    }


def depth_table(entries: list[dict]) -> list[str]:
    """Planner off, per variant that drafts: the share of verifications whose first d drafted tokens were accepted."""
    entries = [s for s in entries if s.get("acceptance_by_depth")]
    if not entries:
        return []
    deepest = max(len(s["acceptance_by_depth"]) for s in entries)
    lines = ["Acceptance by depth (planner off): the share of verifications whose first d drafted tokens the target "
             "accepted.", "", "| dataset | variant | " + " | ".join(f"d = {d}" for d in range(1, deepest + 1)) + " |",
             "|---|---|" + "---|" * deepest]
    for s in entries:
        shares = s["acceptance_by_depth"] + [0.0] * (deepest - len(s["acceptance_by_depth"]))
        lines.append(f"| {s['dataset']} | {s['variant']} | " + " | ".join(f"{p:.3f}" for p in shares) + " |")
    return lines + [""]


def markdown(results: dict) -> str:
    setup = results["setup"]
    sampling = f"T = {setup['temperature']:g}" if setup["temperature"] else "greedy"
    lines = [f"# SPECTRA: {', '.join(DATASETS)} (turn 1), {sampling}, single stream", "",
             f"Command: `{results['command']}`", ""]
    for phase, title in (("headline", f"Headline: first {setup['headline_questions']} questions of each set, "
                                      f"{setup['max_tokens']} new tokens; speedup over `none` in the same run."),
                         ("planner-off", f"Planner off (first {setup['planner_off_questions']} questions): every "
                                         "guess verified, every pool chain carried, the paper's tokens per call."),
                         ("ablation", f"Ablation (planner on, first {setup['ablation_questions']} questions): "
                                      "each component taken away in turn, the paper's Table 2."),
                         ("agentic", f"Agentic: {setup['agentic_requests']} requests from separate conversations "
                                     "for small functions that repeat one another, one after another, planner on "
                                     "(bench/agentic.py).")):
        entries = [s for s in results["summary"] if s["phase"] == phase]
        if not entries:
            continue
        lines += [title, "", "| dataset | variant | tokens/call | tokens/s | ×none | τ | look-ahead rows/call |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {s['dataset']} | {s['variant']} | {s['tokens_per_call']:.2f} | {s['tokens_per_s']:.1f} | "
                  f"{s['speedup_vs_none']:.2f} | {s['mean_acceptance_length']:.2f} | {s['lookahead_rows_per_call']} |"
                  for s in entries]
        lines.append("")
    lines += depth_table([s for s in results["summary"] if s["phase"] == "planner-off"])
    mismatches = sum(r["exactness"] == "mismatch" for r in results["rows"])
    compared = sum(r["exactness"] != "sampled" for r in results["rows"])
    lines.append(f"Exactness: {mismatches} outputs differ from `none` beyond a near-tie, over {compared} greedy "
                 "generations." if compared else "Sampled outputs are not compared token by token.")
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
    """The headline, planner-off, ablation and agentic phases, each phase's engines freed before the next one's
    start."""
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = {"headline_questions": args.limit if args.limit is not None else 10, "max_tokens": args.max_new_tokens,
             "planner_off_questions": args.planner_off_limit, "ablation_questions": args.grid_limit,
             "datasets": list(DATASETS),
             "ablation": [variant.label for variant in ABLATION], "agentic_requests": args.agentic,
             "temperature": args.temperature}
    rows: list[dict] = []
    if any(setup[f"{phase}_questions"] for phase in ("headline", "planner_off", "ablation")):
        rows += run_question_phases(args, config, tokenizer, setup, out_dir)
        gc.collect()
    if args.agentic:
        rows += run_agentic(args, config, tokenizer)
    return write_results(rows, setup, out_dir)


def run_question_phases(args, config, tokenizer, setup: dict, out_dir: Path) -> list[dict]:
    """The headline, planner-off and ablation phases on the first questions of each set. `none` serves every phase
    (each greedy output's reference); the other engines are freed after their phase."""
    limits = {"headline": setup["headline_questions"], "planner-off": setup["planner_off_questions"],
              "ablation": setup["ablation_questions"]}
    prompts = {d: first_turn_prompts(tokenizer, d, max(limits.values()), args.data_dir) for d in DATASETS}
    warm = prompts[DATASETS[0]][0][1]
    none = make_runner(Variant("none"), config, args.temperature)
    none.generate(warm, 8)
    if limits["ablation"] and not corpus_path(model_cache_dir(config.model), weights_fingerprint(
            none.engine.runner.model, none.engine.weights)).exists():
        raise SystemExit("the ablation compares the filtered corpus with an unfiltered one: run `specserve calibrate "
                         "corpus` first (or --grid-limit 0)")
    unfiltered = unfiltered_corpus(none, tokenizer) if limits["ablation"] else None
    rows: list[dict] = []
    for phase, variants in (("headline", with_draft_variants(HEADLINE, config)),
                            ("planner-off", with_draft_variants(PLANNER_OFF, config)), ("ablation", ABLATION)):
        if not limits[phase]:
            continue
        runners = {Variant("none"): none}
        runners.update({variant: make_runner(variant, config, args.temperature, unfiltered)
                        for variant in variants[1:]})
        for runner in list(runners.values())[1:]:  # one-off costs stay out of the measurements
            runner.generate(warm, 8)
        few = {d: pairs[:limits[phase]] for d, pairs in prompts.items()}
        rows += run_phase(phase, few, runners, none.engine.runner.model, args.max_new_tokens)
        write_results(rows, setup, out_dir)
        runners.clear()
        gc.collect()
    return rows


def run_agentic(args, config, tokenizer) -> list[dict]:
    """The agentic phase, in engines of its own (a fresh traffic index): each variant warmed on an unrelated
    prompt first. Every request is a conversation of its own, so the session cache is off: in its implicit mode a
    prompt that repeats an earlier one exactly resumes that conversation's drafter state, the earlier answer in it,
    and the variants without the traffic index would draft from another request's answer after all."""
    config = replace(config, sessions=replace(config.sessions, mode="off"))
    prompts = agentic_prompts(tokenizer, args.agentic)
    runners = {variant: make_runner(variant, config, args.temperature) for variant in AGENTIC}
    warm = first_turn_prompts(tokenizer, DATASETS[0], 1, args.data_dir)[0][1]
    for runner in runners.values():
        runner.generate(warm, 8)
    rows = run_phase("agentic", {"agentic": prompts}, runners, runners[Variant("none")].engine.runner.model,
                     args.max_new_tokens)
    runners.clear()
    gc.collect()
    return rows
