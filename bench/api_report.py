"""The API-feature benchmark's summary rows, mismatches and files (results.json, results.md)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from bench.exactness import first_difference

BASELINE, SPECULATIVE = "none", "copyspec"  # drafters: SPECULATIVE's outputs must be BASELINE's
ORDER_NOTE = ("Both servers up at once, each warmed up (plainly and once per variant); for each conversation, turn 1 "
              "is answered plainly by `none`, then each variant's turn 2 goes to both servers back to back, in an "
              "order reversed at every other pair, so every ratio compares requests seconds apart; `measured_at_s` in "
              "results.json says when each was sent.")
COLUMNS_NOTE = ("tok/s = completion tokens over the requests' summed wall seconds (prefill included); τ = copyspec's "
                "mean acceptance length; identical = copyspec outputs textually identical to none's; valid = "
                "structured outputs that parse (json_schema: JSON matching the schema; tool_call: one `answer` call "
                "with JSON arguments), none · copyspec; at max = outputs cut at max_tokens, none · copyspec; = plain = "
                "none's outputs identical to its plain output (a field that changes nothing leaves them all equal).")


def outputs(records: list[dict], variant: str, drafter: str) -> dict[int, dict]:
    """question_id -> the record of VARIANT on DRAFTER's server."""
    return {r["question_id"]: r for r in records if (r["variant"], r["drafter"]) == (variant, drafter)}


def tokens_per_s(group: list[dict]) -> float:
    seconds = sum(r["seconds"] for r in group)
    return round(sum(r["completion_tokens"] for r in group) / seconds, 3) if seconds else 0.0


def count_valid(group: list[dict]) -> int | None:
    """Outputs of a structured variant that parse; None for a variant without a structure."""
    checks = [r["valid"] for r in group if r["valid"] is not None]
    return sum(checks) if checks else None


def summary_row(records: list[dict], variant: str) -> dict:
    """One variant's row over the conversations both servers answered."""
    base, spec = outputs(records, variant, BASELINE), outputs(records, variant, SPECULATIVE)
    plain = outputs(records, "plain", BASELINE) if variant != "plain" else {}
    both = [q for q in base if q in spec]
    base_group, spec_group = [base[q] for q in both], [spec[q] for q in both]
    num_drafts, accepted = sum(r["num_drafts"] for r in spec_group), sum(r["accepted_tokens"] for r in spec_group)
    none_speed, spec_speed = tokens_per_s(base_group), tokens_per_s(spec_group)
    return {
        "variant": variant, "num_conversations": len(both),
        "none_tokens_per_s": none_speed, "copyspec_tokens_per_s": spec_speed,
        "copyspec_over_none": round(spec_speed / none_speed, 3) if none_speed else None,
        "mean_acceptance_length": round(1 + accepted / num_drafts, 3) if num_drafts else 1.0,
        "identical": sum(spec[q]["text"] == base[q]["text"] for q in both),
        "valid_none": count_valid(base_group), "valid_copyspec": count_valid(spec_group),
        "at_max_tokens_none": sum(r["finish_reason"] == "length" for r in base_group),
        "at_max_tokens_copyspec": sum(r["finish_reason"] == "length" for r in spec_group),
        "none_equal_plain": sum(base[q]["text"] == plain[q]["text"] for q in both if q in plain) if plain else None,
    }


def summary_rows(records: list[dict]) -> list[dict]:
    return [summary_row(records, variant) for variant in dict.fromkeys(r["variant"] for r in records)]


def mismatches(records: list[dict]) -> list[dict]:
    """Every copyspec output that is not textually none's, with the first character where they part."""
    found = []
    for r in records:
        base = outputs(records, r["variant"], BASELINE).get(r["question_id"])
        if r["drafter"] == SPECULATIVE and base is not None and r["text"] != base["text"]:
            found.append({"variant": r["variant"], "question_id": r["question_id"],
                          "first_difference_at_char": first_difference(base["text"], r["text"])})
    return found


def _cell(value, spec: str = "") -> str:
    return "–" if value is None else format(value, spec)


def table_line(row: dict) -> str:
    n = row["num_conversations"]
    valid = "–" if row["valid_none"] is None else f"{row['valid_none']}/{n} · {row['valid_copyspec']}/{n}"
    return (f"| {row['variant']} | {n} | {row['none_tokens_per_s']:.1f} | {row['copyspec_tokens_per_s']:.1f} | "
            f"{_cell(row['copyspec_over_none'], '.2f')} | {row['mean_acceptance_length']:.2f} | "
            f"{row['identical']}/{n} | {valid} | {row['at_max_tokens_none']} · {row['at_max_tokens_copyspec']} | "
            f"{_cell(row['none_equal_plain'])}{'' if row['none_equal_plain'] is None else f'/{n}'} |")


def verdict_lines(rows: list[dict], found: list[dict]) -> list[str]:
    """Which variants copyspec slows down, and the lossless check, failures in bold with every output that differs."""
    slower = [f"{r['variant']} ({r['copyspec_over_none']:.2f}×)" for r in rows
              if (r["copyspec_over_none"] or 1.0) < 1.0]
    lines = [f"**Slower with copyspec than without: {', '.join(slower)}.**" if slower else
             "No variant is slower with copyspec than without.", ""]
    if not found:
        return lines + ["Lossless: every copyspec output is textually identical to none's."]
    lines.append(f"**LOSSLESS CHECK FAILED: {len(found)} copyspec outputs differ from none's** (a divergence at a "
                 "near-tie of the top-2 logits is not told apart here; the texts are in results.json):")
    return lines + [f"- {m['variant']}, question {m['question_id']}: first difference at character "
                    f"{m['first_difference_at_char']}" for m in found]


def markdown_report(rows: list[dict], found: list[dict], command: str, setup: dict, measured: int) -> str:
    """MEASURED: conversations measured so far."""
    so_far = "" if measured == setup["num_conversations"] else f" of {setup['num_conversations']} (so far)"
    lines = ["# API features, MT-Redundant turn 2: copyspec vs none", "", ORDER_NOTE, "", f"Command: `{command}`", "",
             f"Conversations: {measured}{so_far}; one client, greedy, unstreamed, at most {setup['max_new_tokens']} "
             f"new tokens, sessions off. {COLUMNS_NOTE}", "",
             "| variant | n | none tok/s | copyspec tok/s | copyspec/none | τ | identical | valid | at max | = plain |",
             "|" + "---|" * 10, *map(table_line, rows), ""]
    return "\n".join(lines + verdict_lines(rows, found)) + "\n"


def write_api_results(records: list[dict], command: str, setup: dict, out_dir: Path) -> dict:
    """results.json (setup, summary, mismatches, every record with its text) and results.md; returns the former."""
    rows, found = summary_rows(records), mismatches(records)
    results = {"benchmark": "api", "command": command,
               "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "setup": setup,
               "summary": rows, "mismatches": found, "records": records}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    measured = len({r["question_id"] for r in records})
    (out_dir / "results.md").write_text(markdown_report(rows, found, command, setup, measured))
    return results
