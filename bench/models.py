"""`specserve bench models`: speculative decoding with a draft model, at several batch sizes, against plain decoding.

Modes, one in-process engine each, all loaded up front: `none` (plain decoding); `sd-k5`, `sd-k7` (the draft model
drafts k tokens every step, all verified); `sd-planner` (at most 5, the goodput planner decides how many); `sv` (the
same with the companion's estimates: run `specserve calibrate sv` first; its report, if written to
OUT/calibration.json, goes into results.json); `copyspec` and `copyspec+draft` (CopySpec, and CopySpec falling back to
the draft model); `none-control` (plain decoding again, in an engine of its own built last: what two engines doing
the same work differ by in one process, the noise floor of every × none ratio beside it; two plain engines differed
by 0.3-1.8 % at B = 1). Every mode answers MT-Bench turn 1; the copy modes also answer MT-Redundant turn 2 after
`none`'s greedy turn-1 answer, where copyspec+draft is compared with copyspec.

A batch of B is B requests submitted at once (continuous batching, no HTTP), timed to its last token. Each batch size
runs rounds on the next B questions until --min-requests were answered (two rounds at least), every mode taking its
turn within a round (the order reversed every other round) so the machine's drift hits all alike; a row gives the
totals over its rounds and its ratio to each round's own `none` batch. Sessions are off, so no round inherits a
cached prefix or drafter state. Greedy rows say whether every output equals `none`'s (near-ties as in
bench/exactness.py); sampled rows (temperature 0.7) are seeded by question, so plain decoding and point-mass drafts
sample the same tokens (engine/verifier.py).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import msgspec

from bench.data import load_questions
from bench.exactness import divergence_verdict
from bench.mt import turn_prompts
from engine.engine import Engine, freeze_start_up_objects
from engine.model.draft_model import MODEL_DRAFTERS
from engine.wire import EngineRequest, SamplingParams

MODES = {  # mode -> (drafter, goodput planner, drafted tokens, companion)
    "none": ("none", True, 5, False),
    "sd-k5": ("draft", False, 5, False),
    "sd-k7": ("draft", False, 7, False),
    "sd-planner": ("draft", True, 5, False),
    "sv": ("draft", True, 5, True),
    "copyspec": ("copyspec", True, 5, False),
    "copyspec+draft": ("copyspec+draft", True, 5, False),
    "none-control": ("none", True, 5, False),
}
RUNS = [(mode, "mt-bench") for mode in MODES] + [("copyspec", "mt-redundant"), ("copyspec+draft", "mt-redundant")]
DEFAULT_DRAFT, DEFAULT_COMPANION = "early-exit:29", "early-exit:24"  # see the results' README section
TEMPERATURES = (0.0, 0.7)


def mode_engine(args, config, mode: str) -> Engine:
    drafter, planner, num_tokens, companion = MODES[mode]
    config = config.with_drafter(drafter)
    engine = Engine(replace(
        config,
        model=replace(config.model, draft_model=draft_model(args) if drafter in MODEL_DRAFTERS else None,
                      companion_model=companion_model(args) if companion else None),
        scheduler=replace(config.scheduler, use_goodput_planner=planner),
        spec=replace(config.spec, num_draft_tokens=num_tokens),
        sessions=replace(config.sessions, mode="off"),
    ))
    if companion and not engine.speculation.drafter.tables:
        raise SystemExit("the sv mode needs the companion's table: run `specserve calibrate sv` with the same "
                         f"--draft-model {draft_model(args)} --companion-model {companion_model(args)} first")
    return engine


def draft_model(args) -> str:
    return args.draft_model or DEFAULT_DRAFT


def companion_model(args) -> str:
    return args.companion_model or DEFAULT_COMPANION


def run_batch(engine: Engine, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None) -> dict:
    """Submit every prompt at once (a sampled one seeded with its seed in SEEDS); outputs, seconds and speculation
    totals."""
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    seeds = seeds if seeds is not None and not params.greedy else [params.seed] * len(prompts)
    start = time.perf_counter()
    for request_id, prompt, seed in zip(ids, prompts, seeds):
        engine.add_request(EngineRequest(request_id, prompt, msgspec.structs.replace(params, seed=seed)))
    tokens = {request_id: [] for request_id in ids}
    spec = {}
    while engine.has_work:
        for output in engine.step().outputs:
            tokens[output.request_id] += output.new_token_ids
            spec[output.request_id] = output.spec
    return {
        "prompts": prompts, "outputs": [tokens[i] for i in ids], "seconds": time.perf_counter() - start,
        "drafts": sum(s.num_drafts for s in spec.values()),
        "verified_draft_tokens": sum(s.num_draft_tokens for s in spec.values()),
        "accepted_draft_tokens": sum(s.num_accepted_tokens for s in spec.values()),
    }


def totals(batches: list[dict]) -> dict:
    """The rounds' batches of one mode as one: prompts and outputs in order, summed counts, and the figures of a row."""
    total = {key: [x for b in batches for x in b[key]] for key in ("prompts", "outputs")}
    total.update({key: sum(b[key] for b in batches)
                  for key in ("seconds", "drafts", "verified_draft_tokens", "accepted_draft_tokens")})
    verified, accepted, drafts = total["verified_draft_tokens"], total["accepted_draft_tokens"], total.pop("drafts")
    total["tokens_per_s"] = sum(len(t) for t in total["outputs"]) / total["seconds"]
    total["round_tokens_per_s"] = [sum(map(len, b["outputs"])) / b["seconds"] for b in batches]
    total["mean_acceptance_length"] = 1 + accepted / drafts if drafts else 1.0
    total["rejected_share"] = (verified - accepted) / verified if verified else None
    return total


MIN_ROUNDS = 2  # a round's modes run in turn, the order reversed the next round: two balance what drifts meanwhile


def rounds(batch: int, min_requests: int) -> int:
    """Rounds of BATCH requests until MIN_REQUESTS were answered, MIN_ROUNDS at least (with one, the mode that ran last
    took every drift of the round: at B = 64, a second plain engine read 0.91x `none` from last place)."""
    return max(MIN_ROUNDS, math.ceil(min_requests / batch))


def wave(num_questions: int, round_index: int, batch: int) -> list[int]:
    """The indices of the round's B questions: the next B after the rounds before, from the start again past the end."""
    return [(round_index * batch + i) % num_questions for i in range(batch)]


def question_prompts(args, tokenizer, engines: dict[str, Engine]) -> dict[str, list[list[int]]]:
    """MT-Bench turn 1, and MT-Redundant turn 2 after `none`'s greedy turn-1 answer. Every other engine answers the
    same turn-1 batch too, unmeasured: the batch is the most the run holds at once, so each engine's KV pool has
    then been touched as far as any round reaches (the OS backs a pool's pages at first touch, engine/model/
    paged_attention.py). Warmed by it alone, `none` measured a second plain engine at 0.91x at B = 64."""
    bench = [turn_prompts(tokenizer, q, None) for q in load_questions("mt-bench", args.data_dir)]
    needed = max(batch * rounds(batch, args.min_requests) for batch in args.concurrency)
    redundant = load_questions("mt-redundant", args.data_dir)[:needed]
    first_turns = [turn_prompts(tokenizer, q, None) for q in redundant]
    first = run_batch(engines["none"], first_turns, greedy(args))["outputs"]
    for mode, engine in engines.items():
        if mode != "none":
            run_batch(engine, first_turns, greedy(args))
    answers = [tokenizer.decode(a, skip_special_tokens=True) for a in first]
    return {"mt-bench": bench, "mt-redundant": [turn_prompts(tokenizer, q, [a]) for q, a in zip(redundant, answers)]}


def greedy(args) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)


def run_models_benchmark(args: argparse.Namespace, config, tokenizer, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)  # before the run: a path that cannot be a folder fails now, not after it
    modes = args.modes or tuple(MODES)
    runs = [(mode, questions) for mode, questions in RUNS if mode in modes]
    engines = {mode: mode_engine(args, config, mode) for mode in modes}
    prompts = question_prompts(args, tokenizer, engines)
    freeze_start_up_objects()  # as the engine process does
    rows = []
    for level, batch in enumerate(args.concurrency):
        for temperature in TEMPERATURES:
            params = SamplingParams(temperature=temperature, max_tokens=args.max_new_tokens, seed=None)
            results = level_results(engines, prompts, runs, batch, rounds(batch, args.min_requests), params, level)
            rows += level_rows(batch, temperature, results, engines["none"].runner.model)
            print(json.dumps(rows[-len(runs):], default=str), flush=True)
    calibration = out_dir / "calibration.json"
    results = {"command": "specserve " + shlex.join(sys.argv[1:]), "summary": rows, "draft_model": draft_model(args),
               "companion_model": companion_model(args), "max_new_tokens": args.max_new_tokens,
               "min_requests": args.min_requests,
               "calibration": json.loads(calibration.read_text()) if calibration.is_file() else None}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    return results


def level_results(
    engines: dict, prompts: dict, runs: list[tuple[str, str]], batch: int, num_rounds: int, params: SamplingParams,
    level: int,
) -> dict:
    """Per (mode, questions), the totals of NUM_ROUNDS batches of B, the runs taking turns within each round (the order
    reversed every other round, and every other level)."""
    batches = {run: [] for run in runs}
    for round_index in range(num_rounds):
        for mode, questions in (runs if (level + round_index) % 2 == 0 else runs[::-1]):
            indices = wave(len(prompts[questions]), round_index, batch)
            batch_prompts = [prompts[questions][i] for i in indices]
            batches[mode, questions].append(run_batch(engines[mode], batch_prompts, params, seeds=indices))
    return {run: totals(run_batches) for run, run_batches in batches.items()}


def level_rows(batch: int, temperature: float, results: dict, model) -> list[dict]:
    """A row per run: MT-Bench runs against `none`, and copyspec+draft against copyspec on the same questions."""
    rows = []
    for (mode, questions), result in results.items():
        row = {"batch_size": batch, "temperature": temperature, "mode": mode, "questions": questions,
               "all_identical_to_baseline": None}
        row.update({k: v for k, v in result.items() if k not in ("prompts", "outputs")})
        if questions == "mt-bench":
            row.update(compared(result, results["none", questions], temperature, model, "none"))
        if mode == "copyspec+draft" and ("copyspec", questions) in results:
            row.update(compared(result, results["copyspec", questions], temperature, model, "copyspec"))
        rows.append(row)
    return rows


def compared(result: dict, baseline: dict, temperature: float, model, name: str) -> dict:
    """RESULT's speed as a multiple of BASELINE's, and for greedy runs whether every output equals it (near-ties judged
    as in bench/exactness.py)."""
    key = "baseline" if name == "none" else name
    out = {f"speedup_vs_{name}": result["tokens_per_s"] / baseline["tokens_per_s"],
           f"speedup_vs_{name}_by_round": [
               a / b for a, b in zip(result["round_tokens_per_s"], baseline["round_tokens_per_s"])]}
    if temperature == 0.0:
        out[f"all_identical_to_{key}"] = all(
            divergence_verdict(model, p, a, b) != "mismatch"
            for p, a, b in zip(baseline["prompts"], baseline["outputs"], result["outputs"]))
    return out


def markdown(results: dict) -> str:
    lines = [f"# Draft models: draft `{results['draft_model']}`, companion `{results['companion_model']}`", "",
             f"Command: `{results['command']}`", "",
             "| batch | temp | mode | questions | tokens/s | × none | × none by round (median, range) | mean acc. len "
             "| rejected share | identical |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["summary"]:
        rejected = f"{r['rejected_share']:.2f}" if r["rejected_share"] is not None else "–"
        speedup = " · ".join(f"{r[key]:.2f}{label}"
                             for key, label in (("speedup_vs_none", ""), ("speedup_vs_copyspec", " × copyspec"))
                             if key in r) or "–"
        same = (r["all_identical_to_baseline"] if r["all_identical_to_baseline"] is not None
                else r.get("all_identical_to_copyspec"))
        identical = {None: "–", True: "yes", False: "NO"}[same]
        lines.append(f"| {r['batch_size']} | {r['temperature']} | {r['mode']} | {r['questions']} | "
                     f"{r['tokens_per_s']:.1f} | {speedup} | {by_round(r.get('speedup_vs_none_by_round'))} | "
                     f"{r['mean_acceptance_length']:.2f} | {rejected} | {identical} |")
    lines += calibration_markdown(results["calibration"])
    return "\n".join(lines) + "\n"


def by_round(ratios: list[float] | None) -> str:
    """Per-round ratios against the round's own baseline batch: their median and range (one round: the ratio)."""
    if not ratios:
        return "–"
    if len(ratios) == 1:
        return f"{ratios[0]:.2f} (1 round)"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}, {len(ratios)} rounds)"


def calibration_markdown(calibration: dict | None) -> list[str]:
    if not calibration:
        return []
    lines = ["", f"Companion calibration (`{calibration['command']}`; fitted on half the prompts, scored on the "
             "other):", "",
             "| decoding | tokens | Brier companion | Brier statistical | H(acc) | H(acc\\|S) | H(acc\\|A) "
             "| H(acc\\|S,A) | gain |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode in ("greedy", "sampled"):
        r, g = calibration[mode], calibration[mode]["information_gain"]
        lines.append(f"| {mode} | {r['num_tokens']} | {r['brier_companion']:.4f} | {r['brier_statistical']:.4f} | "
                     f"{g['entropy']:.3f} | {g['given_S']:.3f} | {g['given_A']:.3f} | {g['given_S_and_A']:.3f} | "
                     f"{g['information_gain']:.3f} ({g['information_gain_share']:.0%}) |")
    if "brier_draft_probability" in calibration["greedy"]:  # heads: two more estimators on the same tokens
        lines += ["", "| decoding | Brier statistical by depth | Brier draft head's probability |",
                  "| --- | --- | --- |"]
        lines += [f"| {mode} | {calibration[mode]['brier_statistical_by_depth']:.4f} | "
                  f"{calibration[mode]['brier_draft_probability']:.4f} |" for mode in ("greedy", "sampled")]
    return lines
