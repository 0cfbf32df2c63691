"""The PLD+ benchmark: Spec-Bench's six categories and MT-Redundant's second turns, single stream, greedy.

- main run: the first 20 prompts of each Spec-Bench category (multi-turn conversation, translation,
  summarization, qa, math reasoning, rag) and the first 20 MT-Redundant conversations, every turn, through
  `none`, `pld`, `copyspec`, `pld-plus` with hidden-state ranking, `pld-plus` with attention ranking, and
  transformers' `generate` with `prompt_lookup_num_tokens=10`, question by question (bench/mt.py's harness);
  per PLD+ variant, how often its ranked candidate differed from the first match and which was right.
- ablations on the first 10 summarization prompts at 128 new tokens: the hidden-state layer, the number of
  calibrated heads (5, 10, 20, 50, all) and K (10, 30, 70).

Results: results.json with a `summary` per (category, drafter) and the ablation rows, results.md, a plot.
"""
from __future__ import annotations

import gc
import json
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from bench.data import load_questions
from bench.mt import render_prompt, run_question, warm_up
from bench.runners import EngineRunner, HFRunner
from engine.engine import Engine
from engine.model.model_loader import load_model

SPEC_BENCH_CATEGORIES = ("multi-turn", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
DRAFTERS = ("none", "pld", "copyspec", "pld-plus-hidden", "pld-plus-attention", "hf-pld")
ABLATION_QUESTIONS, ABLATION_MAX_TOKENS = 10, 128
HEAD_COUNTS = (5, 10, 20, 50, None)  # None: every head
LAYER_STRIDE = 2  # the layer sweep takes every other layer (each setting is a fresh engine over 10 prompts)
PEERS = ("hf-pld",)  # transformers' generate on the float32 model: other weights than the engine's, so other answers
K_VALUES = (10, 30, 70)


def spec_bench_category(question: dict) -> str:
    return "multi-turn" if question["category"] in MT_BENCH_CATEGORIES else question["category"]


def benchmark_questions(data_dir: Path | None, limit: int) -> list[dict]:
    """The first LIMIT questions of each Spec-Bench category, then of MT-Redundant, each labelled with its category."""
    chosen, counts = [], defaultdict(int)
    for question in load_questions("spec-bench", data_dir):
        category = spec_bench_category(question)
        if counts[category] < limit:
            counts[category] += 1
            chosen.append({**question, "category": category})
    for question in load_questions("mt-redundant", data_dir)[:limit]:
        chosen.append({**question, "question_id": f"mt-redundant-{question['question_id']}",
                       "category": "mt-redundant"})
    return chosen


def engine_runner(config, drafter: str, **spec):
    return EngineRunner(Engine(config.with_drafter(drafter, **spec)))


def make_runners(args, config) -> dict:
    runners = {name: engine_runner(config, name) for name in ("none", "pld", "copyspec")}
    for ranking in ("hidden", "attention"):
        runners[f"pld-plus-{ranking}"] = engine_runner(config, "pld-plus", pld_plus_ranking=ranking)
    runners["hf-pld"] = HFRunner(load_model(config.with_drafter("none").model), prompt_lookup=True)
    return runners


def ranking_stats(runner) -> dict:
    drafter = runner.engine.speculation.drafter if hasattr(runner, "engine") else None
    return dict(getattr(drafter, "stats", {}))


def run_main(questions: list[dict], runners: dict, tokenizer, args) -> list[dict]:
    rows = []
    reference_model = runners["none"].engine.runner.model
    for question in tqdm(questions, desc="spec-bench"):
        before = {name: ranking_stats(runner) for name, runner in runners.items()}
        question_rows = run_question(question, runners, tokenizer, reference_model, args)
        for name, runner in runners.items():
            after = ranking_stats(runner)
            for row in (r for r in question_rows if r["drafter"] == name and r["turn"] == 1):
                row["ranking"] = {key: after[key] - before[name].get(key, 0) for key in after}
        rows += question_rows
    return rows


def run_ablations(args, config, tokenizer, num_layers: int) -> list[dict]:
    """PLD+ over its hyperparameters on the first summarization prompts: mean acceptance length and tokens/s."""
    questions = [q for q in load_questions("spec-bench", args.data_dir) if q["category"] == "summarization"]
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q["turns"][0]}])
               for q in questions[:ABLATION_QUESTIONS]]
    settings = [("layer", layer, {"pld_plus_ranking": "hidden", "pld_plus_layer": layer})
                for layer in range(1, num_layers, LAYER_STRIDE)]
    settings += [("heads", count or "all", {"pld_plus_ranking": "attention", "pld_plus_num_heads": count or 10**6})
                 for count in HEAD_COUNTS]
    settings += [("K", k, {"pld_plus_max_tokens": k}) for k in K_VALUES]
    rows = []
    for knob, value, spec in tqdm(settings, desc="ablations"):
        runner = engine_runner(config, "pld-plus", **spec)
        generations = [runner.generate(prompt, ABLATION_MAX_TOKENS) for prompt in prompts]
        rows.append(ablation_row(knob, value, generations))
        del runner
        gc.collect()
    return rows


def ablation_row(knob: str, value, generations) -> dict:
    tokens = sum(len(g.token_ids) for g in generations)
    drafts, accepted = sum(g.num_drafts for g in generations), sum(g.accepted_tokens for g in generations)
    return {"knob": knob, "value": value, "tokens_per_s": round(tokens / sum(g.seconds for g in generations), 3),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
            "drafted_tokens": sum(g.drafted_tokens for g in generations), "accepted_tokens": accepted}


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        for category in (row["category"], "all"):
            groups[(category, row["drafter"])].append(row)
    summary = [summary_entry(category, drafter, group) for (category, drafter), group in groups.items()]
    base = {s["category"]: s["tokens_per_s"] for s in summary if s["drafter"] == "none"}
    for s in summary:
        s["speedup_vs_none"] = round(s["tokens_per_s"] / base[s["category"]], 3) if base.get(s["category"]) else None
    return summary


def summary_entry(category: str, drafter: str, group: list[dict]) -> dict:
    tokens, seconds = sum(r["new_tokens"] for r in group), sum(r["seconds"] for r in group)
    drafts, accepted = sum(r["num_drafts"] for r in group), sum(r["accepted_tokens"] for r in group)
    ranking = defaultdict(int)
    for row in group:
        for key, value in row.get("ranking", {}).items():
            ranking[key] += value
    return {"category": category, "drafter": drafter, "num_rows": len(group),
            "tokens_per_s": round(tokens / seconds, 3),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
            "drafted_tokens": sum(r["drafted_tokens"] for r in group), "accepted_tokens": accepted,
            "all_identical_to_baseline": None if drafter in PEERS else all(r["exactness"] != "mismatch" for r in group),
            "ranking": dict(ranking) or None}


def markdown(results: dict) -> str:
    lines = ["# PLD+ on Spec-Bench and MT-Redundant: greedy, single stream", "", f"Command: `{results['command']}`", "",
             f"First {results['setup']['limit']} prompts of each category, every turn, "
             f"{results['setup']['max_new_tokens']} new tokens. Tokens/s (× `none` in the same run, τ = mean "
             "acceptance length; drafted → accepted):", "",
             "| category | " + " | ".join(DRAFTERS) + " |", "|" + "---|" * (len(DRAFTERS) + 1)]
    cells = {(s["category"], s["drafter"]): s for s in results["summary"]}
    for category in [*SPEC_BENCH_CATEGORIES, "mt-redundant", "all"]:
        lines.append(f"| {category} | " + " | ".join(_cell(cells.get((category, d))) for d in DRAFTERS) + " |")
    lines += ["", "PLD+ ranking: how often the ranked candidate differed from the first match, and which of the two "
              "drafted the target's next token then:", ""]
    for drafter in ("pld-plus-hidden", "pld-plus-attention"):
        stats = (cells.get(("all", drafter)) or {}).get("ranking") or {}
        lines.append(f"- {drafter}: {stats.get('differs_from_first_match', 0)} of {stats.get('drafts', 0)} drafts "
                     f"differed; ranked right {stats.get('ranked_right', 0)}, first match right "
                     f"{stats.get('first_match_right', 0)}")
    lines += ["", f"Ablations (first {ABLATION_QUESTIONS} summarization prompts, {ABLATION_MAX_TOKENS} new tokens):",
              "",
              "| knob | value | tokens/s | τ |", "|---|---|---|---|"]
    lines += [f"| {r['knob']} | {r['value']} | {r['tokens_per_s']:.1f} | {r['mean_acceptance_length']:.2f} |"
              for r in results["ablations"]]
    ours = [r for r in results["rows"] if r["drafter"] not in PEERS]
    mismatches = sum(r["exactness"] == "mismatch" for r in ours)
    near_ties = sum(r["exactness"] == "near-tie" for r in ours)
    lines += ["", f"Exactness: of {len(ours)} outputs of specserve's drafters, {mismatches} differ from `none` "
              f"beyond a near-tie ({near_ties} at near-ties). The `hf-pld` peer runs the float32 model where the "
              f"engine serves {results['setup'].get('weights', 'its own weights')}, so its answers are not compared."]
    return "\n".join(lines) + "\n"


def _cell(entry: dict | None) -> str:
    if entry is None:
        return "–"
    return (f"{entry['tokens_per_s']:.1f} ({entry['speedup_vs_none']:.2f}×, τ={entry['mean_acceptance_length']:.2f}; "
            f"{entry['drafted_tokens']}→{entry['accepted_tokens']})")


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = [*SPEC_BENCH_CATEGORIES, "mt-redundant"]
    speed = {(s["category"], s["drafter"]): s["speedup_vs_none"] or 0 for s in summary}
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(DRAFTERS)
    for i, drafter in enumerate(DRAFTERS):
        ax.bar([c + i * width for c in range(len(categories))], [speed.get((c, drafter), 0) for c in categories], width,
               label=drafter)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(categories))], categories, rotation=20)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("speedup over none")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(rows: list[dict], ablations: list[dict], setup: dict, out_dir: Path) -> dict:
    results = {"benchmark": "spec-bench", "command": "specserve " + shlex.join(sys.argv[1:]),
               "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "setup": setup,
               "summary": summarize(rows), "ablations": ablations, "rows": rows}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown(results))
    plot(results["summary"], out_dir / "speedup.png")
    return results


def run_pld_plus_benchmark(args, config, tokenizer, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    limit = args.limit or 20
    setup = {"limit": limit, "max_new_tokens": args.max_new_tokens, "drafters": list(DRAFTERS)}
    runners = make_runners(args, config)
    setup["weights"] = runners["none"].engine.weights
    num_layers = runners["none"].engine.runner.model.config.num_hidden_layers
    warm_up(runners, tokenizer)
    rows = run_main(benchmark_questions(args.data_dir, limit), runners, tokenizer, args)
    write(rows, [], setup, out_dir)
    runners.clear()
    gc.collect()
    return write(rows, run_ablations(args, config, tokenizer, num_layers), setup, out_dir)
