"""`specserve bench NAME`: builds the generators and runs a benchmark."""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.data import load_questions

MT_BENCHMARKS = ("mt-redundant", "mt-bench")
ALL_DRAFTERS = ("none", "copyspec", "hf-greedy", "hf-pld")


def add_bench_parser(commands, add_engine_flags) -> None:
    bench = commands.add_parser("bench", help="measure speed side by side (see bench/README)")
    bench.add_argument("name", choices=MT_BENCHMARKS)
    add_engine_flags(bench)
    bench.add_argument("--drafters", default=",".join(ALL_DRAFTERS), help=f"comma list from {ALL_DRAFTERS}; 'none' is always run")
    bench.add_argument("--limit", type=int, default=None, help="first N questions only")
    bench.add_argument("--max-new-tokens", type=int, default=256)
    bench.add_argument("--out", type=Path, default=None, help="output folder (default bench/results/NAME)")
    bench.add_argument("--data-dir", type=Path, default=None, help="folder with the benchmark .jsonl files")
    bench.add_argument("--resume", action="store_true", help="keep rows already in OUT/results.json")
    bench.add_argument("--peer-turns", type=parse_turns, default=(1, 2), help="turns the hf-* peers answer, e.g. 2")


def parse_turns(text: str) -> tuple[int, ...]:
    turns = tuple(int(t) for t in text.split(","))
    if not set(turns) <= {1, 2}:
        raise argparse.ArgumentTypeError("turns are 1 and/or 2")
    return turns


def parse_drafters(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ALL_DRAFTERS))
    if unknown:
        raise SystemExit(f"unknown drafters {unknown}; choose from {ALL_DRAFTERS}")
    return ["none"] + [n for n in names if n != "none"]


def run_bench(args: argparse.Namespace, engine_config_from_args) -> None:
    from bench.mt import run_mt_benchmark
    from bench.runners import EngineRunner, HFRunner
    from engine.engine import Engine
    from engine.model_loader import load_model
    from server.tokenizer import load_tokenizer

    drafters = parse_drafters(args.drafters)
    runners, hf_model = {}, None
    for name in drafters:
        if name.startswith("hf-"):
            hf_model = hf_model or load_model(engine_config_from_args(args, "none").model)
            runners[name] = HFRunner(hf_model, prompt_lookup=name == "hf-pld")
        else:
            runners[name] = EngineRunner(Engine(engine_config_from_args(args, name)))
    reference_model = runners["none"].engine.runner.model
    questions = load_questions(args.name, args.data_dir)[: args.limit]
    out_dir = args.out or Path(__file__).resolve().parent / "results" / args.name
    tokenizer = load_tokenizer(engine_config_from_args(args, "none").model)
    results = run_mt_benchmark(args.name, questions, runners, tokenizer, reference_model, args, out_dir)
    print((out_dir / "results.md").read_text())
