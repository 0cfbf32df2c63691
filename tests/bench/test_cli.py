"""`specserve bench NAME`: one subcommand per benchmark, its own flags, and help for each."""
import pytest

from bench.cli import BENCHMARKS
from specserve import build_parser, main

OWN_FLAGS = {  # a flag each benchmark has that the others need not
    "mt-redundant": "--peer-turns", "mt-bench": "--per-category", "humaneval": "--max-turns", "gsm8k": "--resume",
    "spec-bench": "--limit", "ngram": "--grid-limit", "spectra": "--grid-limit", "concurrency": "--warm-prompts",
    "sessions": "--session-modes", "roofline": "--graph-max-tokens",
    "step-profile": "--data-dir", "soak": "--soak-clients", "api": "--variants", "models": "--min-requests",
    "long-context": "--definition-tokens", "replicas": "--replica-kv-gib",
    "routing-sim": "--warm-sessions", "cpu-layouts": "--compare",
}


def test_every_benchmark_is_checked_here():
    assert set(OWN_FLAGS) == set(BENCHMARKS)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_has_help_with_its_own_and_the_engine_flags(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert f"specserve bench {name}" in help_text and OWN_FLAGS[name] in help_text
    assert ("--kv-cache-memory" in help_text and "--max-new-tokens" in help_text
            and "--drafter {" not in help_text)  # each chooses its drafters


def test_a_benchmark_refuses_another_benchmarks_flags():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "soak", "--grid-limit", "3"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "models", "--modes", "none,nonsense"])


def test_comma_lists_keep_the_baseline_first():
    args = build_parser().parse_args(["bench", "mt-redundant", "--drafters", "copyspec,none,ngram"])
    assert args.drafters == ("none", "copyspec", "ngram")
    assert build_parser().parse_args(["bench", "models", "--modes", "sv"]).modes == ("none", "sv")


def test_peers_may_be_none_but_drafters_not():
    assert build_parser().parse_args(["bench", "concurrency", "--peers", ""]).peers == ()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "concurrency", "--peers", "nonsense"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "roofline", "--sizes", ""])
