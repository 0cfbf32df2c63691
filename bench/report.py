"""Summaries, markdown tables and plots of benchmark rows."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (drafter, turn, category and "all"), aggregated over questions."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        for category in (row["category"], "all"):
            groups[(row["drafter"], row["turn"], category)].append(row)
    summary = [_summary_entry(key, group) for key, group in sorted(groups.items(), key=_order)]
    baseline = {(s["turn"], s["category"]): s["tokens_per_s"] for s in summary if s["drafter"] == "none"}
    for entry in summary:
        base = baseline.get((entry["turn"], entry["category"]))
        entry["speedup_vs_none"] = round(entry["tokens_per_s"] / base, 3) if base else None
    return summary


def _order(item) -> tuple:
    (drafter, turn, category), _ = item
    return (turn, category == "all", category, drafter)


def _summary_entry(key: tuple, group: list[dict]) -> dict:
    drafter, turn, category = key
    new_tokens = sum(r["new_tokens"] for r in group)
    seconds = sum(r["seconds"] for r in group)
    num_drafts = sum(r["num_drafts"] for r in group)
    accepted = sum(r["accepted_tokens"] for r in group)
    drafted = sum(r["drafted_tokens"] for r in group)
    return {
        "drafter": drafter, "turn": turn, "category": category, "num_questions": len(group),
        "tokens_per_s": round(new_tokens / seconds, 3) if seconds else 0.0,
        # a peer that drafts without saying in how many rounds (llama-server) has no τ
        "mean_acceptance_length": round(1 + accepted / num_drafts, 3) if num_drafts else (None if drafted else 1.0),
        "copied_fraction": round(accepted / new_tokens, 4) if new_tokens else 0.0,
        "all_identical_to_baseline": all(r["identical_to_baseline"] for r in group),
    }


def markdown_table(summary: list[dict], drafters: list[str]) -> str:
    """Rows: turn and category; columns: tokens/s (speedup) and τ per drafter."""
    cells = {(s["turn"], s["category"], s["drafter"]): s for s in summary}
    header = "| turn | category | " + " | ".join(f"{d} tok/s (×none, τ)" for d in drafters) + " |"
    lines = [header, "|" + "---|" * (len(drafters) + 2)]
    for turn, category in dict.fromkeys((s["turn"], s["category"]) for s in summary):
        values = [_cell(cells.get((turn, category, d))) for d in drafters]
        lines.append(f"| {turn} | {category} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def _cell(entry: dict | None) -> str:
    if entry is None:
        return "–"
    tau = entry["mean_acceptance_length"]
    return f"{entry['tokens_per_s']:.1f} ({entry['speedup_vs_none']:.2f}×, τ={'–' if tau is None else f'{tau:.2f}'})"


def plot_speedups(summary: list[dict], drafters: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = sorted({s["turn"] for s in summary})
    fig, axes = plt.subplots(1, len(turns), figsize=(7 * len(turns), 4), squeeze=False)
    for ax, turn in zip(axes[0], turns):
        categories = list(dict.fromkeys(s["category"] for s in summary if s["turn"] == turn))
        width = 0.8 / len(drafters)
        for i, drafter in enumerate(drafters):
            values = {s["category"]: s["tokens_per_s"] for s in summary
                      if s["turn"] == turn and s["drafter"] == drafter}
            ax.bar([c + i * width for c in range(len(categories))], [values.get(c, 0) for c in categories], width,
                   label=drafter)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(categories))], categories, rotation=30)
        ax.set_title(f"turn {turn}")
        ax.set_ylabel("tokens/s")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
