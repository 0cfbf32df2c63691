"""The roofline benchmark, run for real on the CPU with its tiny shape: the rows the GPU run commits, the projection
from the CPU acceptance, and the join of a device's MT-Redundant rows."""
from __future__ import annotations

import json

import pytest

from bench.roofline import join_drafter_rows, run_roofline, verify_cost
from specserve import build_parser


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("roofline")
    args = build_parser().parse_args([
        "bench", "roofline", "--device", "cpu", "--sizes", "tiny", "--batch-sizes", "1,2", "--verify-tokens", "1,4,16",
        "--out", str(out),
    ])
    return out, run_roofline(args, "cpu", out)


def test_each_size_and_batch_gets_a_measured_row_with_its_bound(tiny_results):
    out, results = tiny_results
    rows = results["summary"]
    assert [(r["model_size"], r["batch_size"]) for r in rows] == [("tiny", 1), ("tiny", 2)]
    for row in rows:
        assert 0 < row["bound_seconds"] < row["step_seconds"]
        assert row["fraction_of_roofline"] == pytest.approx(row["bound_seconds"] / row["step_seconds"])
        assert row["verify1_over_1"] == 1.0 and row["verify4_over_1"] > 0 and row["verify16_over_1"] > 0
        assert row["verify16_host_logits_over_argmax"] > 0
        assert row["attention_seconds"] > 0 and 0 < row["attention_bound_seconds"] < row["bound_seconds"]
        assert row["projected_copyspec_speedup"] > 0  # from the committed CPU MT-Redundant acceptance
    assert rows[0]["hf_step_seconds"] > 0 and rows[1]["hf_step_seconds"] is None  # transformers at batch 1 only
    assert json.loads((out / "results.json").read_text())["summary"] == rows
    assert (out / "roofline.png").stat().st_size > 0 and "| tiny | 2 |" in (out / "results.md").read_text()


def test_a_devices_mt_redundant_rows_join_the_measured_ones(tiny_results, tmp_path):
    out, results = tiny_results
    mt = tmp_path / "mt.json"
    summary = [{"drafter": d, "turn": 2, "category": "all", "tokens_per_s": t, "speedup_vs_none": s,
                "mean_acceptance_length": 1.0, "all_identical_to_baseline": True}
               for d, t, s in (("none", 100.0, 1.0), ("copyspec", 300.0, 3.0))]
    mt.write_text(json.dumps({"command": "specserve bench mt-redundant", "summary": summary}))
    joined = join_drafter_rows(out, mt)
    assert joined["summary"][:2] == results["summary"]
    assert [(r["drafter"], r["speedup_vs_none"]) for r in joined["summary"][2:]] == [("none", 1.0), ("copyspec", 3.0)]
    assert "| copyspec | 300.0 | 3.0 |" in (out / "results.md").read_text()


def test_the_verify_cost_is_read_off_the_curve_between_its_points():
    curve = {1: 1.0, 4: 1.3, 16: 2.5}
    assert verify_cost(curve, 1) == 1.0 and verify_cost(curve, 4) == 1.3
    assert verify_cost(curve, 10) == pytest.approx(1.9) and verify_cost(curve, 40) == 2.5
