"""Conversation benchmarks (MT-Bench, MT-Redundant, Spec-Bench, HumanEval, GSM8K): tokens/s per drafter, side by
side in one run.

Each turn is answered by the baseline; its answer goes into the history of the next
turn. Every drafter then answers every turn (up to --max-turns); each row records
its speed and whether its tokens equal the baseline's.
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from tqdm import tqdm

from bench.exactness import divergence_verdict
from bench.lookup_cost import copyspec_lookup_cost
from bench.report import markdown_table, plot_speedups, summarize
from bench.runners import generate_together


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def turn_prompts(tokenizer, question: dict, answers: list[str] | str | None) -> list[int]:
    """The prompt of the turn after ANSWERS (the baseline's answers to the turns before; None or [] for turn 1)."""
    answers = [answers] if isinstance(answers, str) else list(answers or [])
    messages = []
    for user_text, answer in zip(question["turns"], answers):
        messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": question["turns"][len(answers)]})
    return render_prompt(tokenizer, messages)


def completion_prompt(tokenizer, question: dict) -> list[int]:
    """A base model's prompt: the question's text to continue, no chat template."""
    return list(tokenizer.encode(question["completion"]))


def warm_up(runners: dict, tokenizer, completions: bool = False) -> None:
    """One short untimed generation per runner, so one-off costs stay out of the measurements."""
    hello = "Say hello."
    prompt = tokenizer.encode(hello) if completions else render_prompt(tokenizer, [{"role": "user", "content": hello}])
    for runner in runners.values():
        runner.generate(prompt, 16)


def run_question(question: dict, runners: dict, tokenizer, reference_model, args) -> list[dict]:
    rows, answers = [], []
    num_turns = 1 if args.completions else min(len(question["turns"]), args.max_turns)
    for turn in range(1, num_turns + 1):
        prompt = (completion_prompt(tokenizer, question) if args.completions
                  else turn_prompts(tokenizer, question, answers))
        names = [n for n in runners if not n.startswith("hf-") or turn in args.peer_turns]
        generations = generate_together({name: runners[name] for name in names}, prompt, args.max_new_tokens)
        baseline = generations["none"].token_ids
        baseline_text = tokenizer.decode(baseline, skip_special_tokens=True)
        for name, gen in generations.items():
            if getattr(runners[name], "is_peer_server", False):
                rows.append(_peer_row(question, turn, name, gen, baseline_text, generations))
            else:
                rows.append(_row(question, turn, name, gen,
                                 divergence_verdict(reference_model, prompt, baseline, gen.token_ids)))
        answers.append(baseline_text)
    return rows


def _peer_row(question: dict, turn: int, name: str, gen, baseline_text: str, generations: dict) -> dict:
    """A peer server's row: its kernels are not ours, so it is compared by text (no near-tie rule), with specserve's
    `none` and, for its speculative configuration, with its own plain output."""
    row = _row(question, turn, name, gen, "identical" if gen.text == baseline_text else "differs")
    plain = generations.get(name.removesuffix("-spec")) if name.endswith("-spec") else None
    row["identical_to_peer_plain"] = None if plain is None else gen.text == plain.text
    return row


def _row(question: dict, turn: int, drafter: str, gen, verdict: str) -> dict:
    new_tokens = len(gen.token_ids)
    return {
        "question_id": question["question_id"], "category": question["category"], "turn": turn,
        "drafter": drafter, "new_tokens": new_tokens, "seconds": round(gen.seconds, 4),
        "tokens_per_s": round(new_tokens / gen.seconds, 3), "num_forwards": gen.num_forwards,
        "num_drafts": gen.num_drafts,
        "drafted_tokens": gen.drafted_tokens, "accepted_tokens": gen.accepted_tokens,
        "identical_to_baseline": verdict == "identical", "exactness": verdict,
    }


def run_mt_benchmark(
    name: str, questions: list[dict], runners: dict, tokenizer, reference_model, args, out_dir: Path
) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = _load_previous_rows(out_dir) if args.resume else []
    done = {r["question_id"] for r in rows}
    warm_up(runners, tokenizer, args.completions)
    for question in tqdm([q for q in interleave_categories(questions) if q["question_id"] not in done], desc=name):
        rows += run_question(question, runners, tokenizer, reference_model, args)
        write_results(name, rows, list(runners), args, out_dir, lookup_cost=None)
    lookup = copyspec_lookup_cost(args.copy_gamma, args.copy_max_tokens)
    return write_results(name, rows, list(runners), args, out_dir, lookup_cost=lookup)


def interleave_categories(questions: list[dict]) -> list[dict]:
    """First question of every category, then the second, ...: a run cut short still covers them all."""
    rank: dict[str, int] = {}
    keyed = []
    for position, question in enumerate(questions):
        rank[question["category"]] = rank.get(question["category"], -1) + 1
        keyed.append((rank[question["category"]], position, question))
    return [question for *_, question in sorted(keyed, key=lambda item: item[:2])]


def _load_previous_rows(out_dir: Path) -> list[dict]:
    path = out_dir / "results.json"
    return json.loads(path.read_text())["rows"] if path.exists() else []


def _peer_lines(rows: list[dict]) -> list[str]:
    """Per peer server and turn: outputs textually identical to specserve `none`, and to the peer's own plain output."""
    lines = []
    for name in dict.fromkeys(r["drafter"] for r in rows
                              if r["exactness"] == "differs" or "identical_to_peer_plain" in r):
        for turn in sorted({r["turn"] for r in rows if r["drafter"] == name}):
            mine = [r for r in rows if r["drafter"] == name and r["turn"] == turn]
            line = (f"{name}, turn {turn}: {sum(r['identical_to_baseline'] for r in mine)} of {len(mine)} outputs "
                    "textually identical to `none`")
            own = [r["identical_to_peer_plain"] for r in mine if r.get("identical_to_peer_plain") is not None]
            if own:
                line += f", {sum(own)} of {len(own)} to its own plain output"
            lines.append(line + ".")
    return lines


def write_results(name: str, rows: list[dict], drafters: list[str], args, out_dir: Path, lookup_cost) -> dict:
    summary = summarize(rows)
    results = {
        "benchmark": name,
        "command": "specserve " + shlex.join(sys.argv[1:]),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "max_new_tokens": args.max_new_tokens,
        "num_questions": len({r["question_id"] for r in rows}),
        "copyspec_lookup_us_per_token": lookup_cost,
        "summary": summary,
        "rows": rows,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown_table(summary, drafters)
    (out_dir / "results.md").write_text(_markdown(results, table))
    plot_speedups(summary, drafters, out_dir / "tokens_per_s.png")
    return results


def _markdown(results: dict, table: str) -> str:
    mismatches = sum(r["exactness"] == "mismatch" for r in results["rows"])
    near_ties = sum(r["exactness"] == "near-tie" for r in results["rows"])
    peers = _peer_lines(results["rows"])
    lookup = results["copyspec_lookup_us_per_token"]
    lines = [
        f"# {results['benchmark']}: {results['num_questions']} questions, {results['max_new_tokens']} new tokens, "
        "greedy",
        "", f"Command: `{results['command']}`", "",
        "Tokens/s (speedup over `none` in the same run, τ = mean acceptance length):", "", table,
        f"Exactness: {mismatches} outputs differ from the baseline beyond a near-tie; {near_ties} diverge at a "
        "near-tie.",
        *peers,
    ]
    if lookup:
        lines.append(f"CopySpec extend + lookup: {lookup['1000']:.2f} µs/token at a 1k context, "
                     f"{lookup['16000']:.2f} µs/token at 16k.")
    return "\n".join(lines) + "\n"
