"""The documentation against the code: every `--flag` the docs name exists in the `specserve` parser (no flag list
is written by hand: `specserve serve --help` is the reference), README.md stays a landing page, and nothing in
the repository points outside it."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from bench.replicas import ROUTER_FLAGS
from server.flags import parser_flags
from specserve import build_parser

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", REPO / "tests" / "README.md",
        *sorted((REPO / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")
# Flags of other programs that the docs show in their own command lines (pip, pytest, docker, kubectl, llama-server).
OTHER_PROGRAMS_FLAGS = {
    "--no-deps", "--build-arg", "--gpus", "--rm", "--name", "--env", "--publish", "--detach", "--profile",
    "--draft-max", "--draft-min", "--model-draft", "--spec-replace", "--lookup-ngram-min", "--ctx-size", "--threads",
    "--parallel", "--continuous-batching", "--durations", "--collect-only", "--maxfail", "--timeout", "--follow",
}
# smg's flags in the command line docs/deployment.md shows: those the deployment runs with (one home:
# bench/replicas.py), its worker list and metrics port; and docker compose's --build
ROUTER_FLAGS_SHOWN = {flag for flag in ROUTER_FLAGS if flag.startswith("--")} | {"--worker-urls", "--prometheus-port",
                                                                                  "--build"}
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".peers", "build", "tests"}


def documented_flags(path: Path) -> set[str]:
    return set(FLAG.findall(path.read_text()))


def test_there_is_documentation_to_check():
    assert all(path.is_file() for path in DOCS) and len(DOCS) >= 5


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_documented_flag_is_a_flag_of_the_command(path):
    unknown = documented_flags(path) - parser_flags(build_parser()) - OTHER_PROGRAMS_FLAGS - ROUTER_FLAGS_SHOWN
    assert not unknown, f"{path.relative_to(REPO)} names flags specserve does not have: {sorted(unknown)}"


def test_the_check_catches_a_flag_the_parser_lacks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `specserve serve --kv-cache-memory 1 --kv-cache-size 2`.")
    assert documented_flags(page) - parser_flags(build_parser()) == {"--kv-cache-size"}


def test_the_parser_flags_cover_every_subcommand():
    flags = parser_flags(build_parser())
    assert {"--drafter", "--api-key", "--max-choices", "--num-threads", "--served-model-name"} <= flags  # serve
    assert {"--min-requests", "--soak-clients", "--variants", "--session-modes"} <= flags  # benchmarks


def test_the_readme_is_a_landing_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "make serve" in readme and "make test" in readme


def repository_files():
    """Every file of the checkout outside tests/, virtual environments, caches and build outputs."""
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [name for name in subfolders if name not in SKIPPED_DIRS and not name.endswith(".egg-info")]
        yield from (Path(folder, name).relative_to(REPO) for name in files)


def test_no_file_outside_tests_points_to_the_shared_folder_beside_the_checkout():
    pointing = []
    for relative in repository_files():
        try:
            text = (REPO / relative).read_text()
        except UnicodeDecodeError:
            continue  # a binary file (a PNG, the gzipped data set) names no path
        if "../shared" in text:
            pointing.append(str(relative))
    assert pointing == []
