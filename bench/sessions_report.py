"""The session benchmark's summary rows, ratios and files (results.json, results.md, a PNG plot)."""
from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from bench.concurrency import percentile

ORDER = "interleaved by conversation"  # results.json setup["order"]
ORDER_NOTE = ("All servers up at once, each warmed up; each conversation is replayed on every server in turn (the "
              "others idle), in an order reversed at every other conversation, so ratios compare measurements minutes "
              "apart; `measured_at_s` in results.json says when each turn was sent.")
BASELINE = ("off", "none")  # (session_mode, drafter) whose outputs every other server must reproduce
GroupKey = tuple[str, str, str, int]  # (benchmark, session_mode, drafter, turn)


def baseline_texts(records: list[dict]) -> dict[tuple, str]:
    """(benchmark, question_id, turn) -> the baseline server's output."""
    return {(r["benchmark"], r["question_id"], r["turn"]): r["text"] for r in records
            if (r["session_mode"], r["drafter"]) == BASELINE}


def equals_baseline(record: dict, baseline: dict[tuple, str]) -> bool | None:
    """Whether RECORD's output is the baseline's for the same conversation and turn; None without one."""
    text = baseline.get((record["benchmark"], record["question_id"], record["turn"]))
    return None if text is None else record["text"] == text


def grouped(records: list[dict]) -> dict[GroupKey, list[dict]]:
    """Records by (benchmark, session_mode, drafter, turn), ordered as they first appear (turn ascending)."""
    groups: dict[GroupKey, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["benchmark"], r["session_mode"], r["drafter"], r["turn"])].append(r)
    rank = {field: {v: i for i, v in enumerate(dict.fromkeys(r[field] for r in records))}
            for field in ("benchmark", "session_mode", "drafter")}

    def order(key: GroupKey) -> tuple[int, ...]:
        benchmark, session_mode, drafter, turn = key
        return rank["benchmark"][benchmark], turn, rank["session_mode"][session_mode], rank["drafter"][drafter]

    return {key: groups[key] for key in sorted(groups, key=order)}


def summary_row(key: GroupKey, group: list[dict], baseline: dict[tuple, str]) -> dict:
    """One results.json summary row; times in seconds, tokens/s over the turn's summed end-to-end seconds."""
    benchmark, session_mode, drafter, turn = key
    ttfts = sorted(r["ttft_s"] for r in group)
    completion = sum(r["completion_tokens"] for r in group)
    seconds = sum(r["e2e_s"] for r in group)
    accepted = sum(r["accepted_tokens"] for r in group)
    num_drafts = sum(r["num_drafts"] for r in group)
    matches = [m for m in (equals_baseline(r, baseline) for r in group) if m is not None]
    return {
        "benchmark": benchmark, "session_mode": session_mode, "drafter": drafter, "turn": turn,
        "num_conversations": len(group),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p90_s": round(percentile(ttfts, 0.9), 4),
        "tokens_per_s": round(completion / seconds, 3) if seconds else 0.0,
        "copied_fraction": round(accepted / completion, 4) if completion else 0.0,
        "mean_acceptance_length": round(1 + accepted / num_drafts, 3) if num_drafts else 1.0,
        "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] for r in group), 1),
        "cached_tokens_mean": round(statistics.mean(r["cached_tokens"] for r in group), 1),
        "completion_tokens": completion,
        "outputs_equal_baseline": sum(matches) if matches else None,
    }


def summary_rows(records: list[dict]) -> list[dict]:
    baseline = baseline_texts(records)
    return [summary_row(key, group, baseline) for key, group in grouped(records).items()]


def server_label(row: dict) -> str:
    return f"{row['session_mode']}/{row['drafter']}"


def ratio_entry(row: dict, metric: str, numerator: dict, denominator: dict, value: float) -> dict:
    return {"benchmark": row["benchmark"], "turn": row["turn"], "metric": metric,
            "numerator": server_label(numerator), "denominator": server_label(denominator), "ratio": round(value, 3)}


def ttft_ratios(summary: list[dict]) -> list[dict]:
    """Per benchmark, turn and drafter: TTFT p50 with sessions off ÷ with each session mode (above 1: sessions help)."""
    rows = {(r["benchmark"], r["turn"], r["session_mode"], r["drafter"]): r for r in summary}
    ratios = []
    for (benchmark, turn, mode, drafter), row in rows.items():
        off = rows.get((benchmark, turn, "off", drafter))
        if mode != "off" and off and row["ttft_p50_s"]:
            ratios.append(ratio_entry(row, "ttft_p50_s", off, row, off["ttft_p50_s"] / row["ttft_p50_s"]))
    return ratios


def speed_ratios(summary: list[dict]) -> list[dict]:
    """Per benchmark, turn and session mode: each drafter's tokens/s ÷ `none` in the same mode, and ÷ `off/none`."""
    rows = {(r["benchmark"], r["turn"], r["session_mode"], r["drafter"]): r for r in summary}
    ratios = []
    for (benchmark, turn, mode, drafter), row in rows.items():
        if drafter == "none":
            continue
        for base_mode in dict.fromkeys((mode, "off")):
            base = rows.get((benchmark, turn, base_mode, "none"))
            if base and base["tokens_per_s"]:
                ratios.append(ratio_entry(row, "tokens_per_s", row, base, row["tokens_per_s"] / base["tokens_per_s"]))
    return ratios


def written_record(record: dict, baseline: dict[tuple, str]) -> dict:
    """A record for results.json: the text kept only for the baseline and for outputs that differ from it."""
    equal = equals_baseline(record, baseline)
    is_baseline = (record["session_mode"], record["drafter"]) == BASELINE
    kept = {k: v for k, v in record.items() if k != "text" or is_baseline or equal is False}
    return {**kept, "equal_baseline": equal}


def _cell(value, spec: str = "") -> str:
    return "–" if value is None else format(value, spec)


def summary_table(summary: list[dict]) -> list[str]:
    lines = ["| benchmark | sessions | drafter | turn | n | TTFT p50 s | tok/s | copied | τ | prompt tok | cached tok "
             "| = off/none |",
             "|" + "---|" * 12]
    for r in summary:
        lines.append(f"| {r['benchmark']} | {r['session_mode']} | {r['drafter']} | {r['turn']} | "
                     f"{r['num_conversations']} | {r['ttft_p50_s']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['copied_fraction']:.2f} | {r['mean_acceptance_length']:.2f} | "
                     f"{r['prompt_tokens_mean']:.0f} | {r['cached_tokens_mean']:.0f} | "
                     f"{_cell(r['outputs_equal_baseline'])} |")
    return lines


def _ratio_column(ratio: dict) -> str:
    return f"{ratio['numerator']} ÷ {ratio['denominator']}"


def ratio_table(ratios: list[dict]) -> list[str]:
    """Rows: benchmark and turn; columns: numerator ÷ denominator."""
    columns = list(dict.fromkeys(_ratio_column(q) for q in ratios))
    cells = {(q["benchmark"], q["turn"], _ratio_column(q)): q["ratio"] for q in ratios}
    lines = ["| benchmark | turn | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 2)]
    for benchmark, turn in dict.fromkeys((q["benchmark"], q["turn"]) for q in ratios):
        values = [_cell(cells.get((benchmark, turn, c)), ".2f") for c in columns]
        lines.append(f"| {benchmark} | {turn} | " + " | ".join(values) + " |")
    return lines


def measured_conversations(records: list[dict]) -> dict[str, int]:
    """Per benchmark, how many distinct conversations RECORDS hold."""
    counts: dict[str, int] = {}
    for benchmark, _ in dict.fromkeys((r["benchmark"], r["question_id"]) for r in records):
        counts[benchmark] = counts.get(benchmark, 0) + 1
    return counts


def conversation_counts(planned: dict[str, int], measured: dict[str, int]) -> str:
    """E.g. '2 mt-redundant, 1 self-correction'; '1 of 2 mt-redundant (so far), ...' while a run is partway."""
    parts = []
    for name, n in planned.items():
        done = measured.get(name, 0)
        parts.append(f"{n} {name}" if done == n else f"{done} of {n} {name} (so far)")
    return ", ".join(parts)


def markdown_report(results: dict) -> str:
    setup = results["setup"]
    counts = conversation_counts(setup["num_conversations"], results["conversations_measured"])
    lines = ["# Sessions: multi-turn conversations through the HTTP server", "", ORDER_NOTE, "",
             f"Command: `{results['command']}`", "",
             f"Conversations: {counts}; one client, greedy, at most {setup['max_new_tokens']} new tokens a turn. "
             "TTFT = time to first token; tok/s = completion tokens over end-to-end seconds; copied = accepted drafted "
             "tokens per completion token; τ = mean acceptance length; cached tok = prompt tokens whose KV the server "
             "reused; = off/none = outputs identical to the sessions-off, no-drafter server's.", "",
             *summary_table(results["summary"])]
    for metric, title in (("ttft_p50_s",
                           "Time to first token, p50 sessions off ÷ p50 with sessions (above 1: faster):"),
                          ("tokens_per_s", "Tokens/s, drafter ÷ `none`:")):
        ratios = [q for q in results["ratios"] if q["metric"] == metric]
        if ratios:
            lines += ["", title, "", *ratio_table(ratios)]
    return "\n".join(lines) + "\n"


def replace_text(path: Path, text: str) -> None:
    """Write TEXT beside PATH, then rename it over PATH: a run killed mid-write keeps the previous file whole."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def write_sessions_results(records: list[dict], command: str, setup: dict, out_dir: Path) -> list[dict]:
    """results.json, results.md and ttft_and_speed.png under OUT_DIR (rewritten as a run goes on); returns the
    summary rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summary_rows(records)
    baseline = baseline_texts(records)
    results = {"benchmark": "sessions", "command": command,
               "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "setup": setup,
               "conversations_measured": measured_conversations(records),
               "summary": summary, "ratios": ttft_ratios(summary) + speed_ratios(summary),
               "records": [written_record(r, baseline) for r in records]}
    replace_text(out_dir / "results.json", json.dumps(results, indent=1, ensure_ascii=False, allow_nan=False))
    replace_text(out_dir / "results.md", markdown_report(results))
    plot_turns(summary, out_dir / "ttft_and_speed.png")
    return summary


def plot_turns(summary: list[dict], path: Path) -> None:
    """Top: TTFT p50 per turn; bottom: tokens/s per turn; one column per benchmark, one bar per mode/drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benchmarks = list(dict.fromkeys(r["benchmark"] for r in summary))
    fig, axes = plt.subplots(2, len(benchmarks), figsize=(6 * len(benchmarks), 7), squeeze=False)
    for column, benchmark in enumerate(benchmarks):
        rows = [r for r in summary if r["benchmark"] == benchmark]
        for row_index, (metric, label) in enumerate((("ttft_p50_s", "TTFT p50 (s)"), ("tokens_per_s", "tokens/s"))):
            _bars_by_turn(axes[row_index][column], rows, metric)
            axes[row_index][column].set_ylabel(label)
        axes[0][column].set_title(benchmark)
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bars_by_turn(ax, rows: list[dict], metric: str) -> None:
    turns = sorted({r["turn"] for r in rows})
    series = list(dict.fromkeys((r["session_mode"], r["drafter"]) for r in rows))
    width = 0.8 / len(series)
    values = {(r["session_mode"], r["drafter"], r["turn"]): r[metric] for r in rows}
    for i, (mode, drafter) in enumerate(series):
        heights = [values.get((mode, drafter, t), 0) for t in turns]
        ax.bar([t + (i - (len(series) - 1) / 2) * width for t in turns], heights, width, label=f"{mode} / {drafter}")
    ax.set_xticks(turns, [f"turn {t}" for t in turns])
