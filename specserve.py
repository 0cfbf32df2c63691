"""The `specserve` command: `serve` (server/), `bench` (bench/) and `tables build` (model-derived drafter tables).

It lives beside the packages rather than in `server/`, so that the server never imports the
benchmark harness: this module is the one place that wires both.
"""
from __future__ import annotations

import argparse
import sys

from server.cli import add_engine_flags, add_serve_parser, engine_config_from_args, serve

TABLES = ("bigram",)


def build_parser() -> argparse.ArgumentParser:
    from bench.cli import add_bench_parser

    parser = argparse.ArgumentParser(prog="specserve", description="Lossless speculative LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    add_bench_parser(commands, add_engine_flags)
    tables = commands.add_parser("tables", help="build the tables drafters derive from the model, ahead of serving")
    tables.add_argument("action", choices=("build",))
    add_engine_flags(tables)
    calibrate = commands.add_parser("calibrate", help="calibrate a drafter for the served model (PLD+'s layer and heads)")
    calibrate.add_argument("drafter", choices=("pld-plus",))
    calibrate.add_argument("--max-new-tokens", type=int, default=192, help="tokens of each calibration answer")
    add_engine_flags(calibrate)
    return parser


def calibrate_pld_plus(args: argparse.Namespace) -> None:
    """Answer the calibration prompts (engine/calibration_prompts.py) and keep PLD+'s layer, heads and ranking."""
    import logging

    from engine.calibration import run_calibration
    from engine.calibration_prompts import CALIBRATION_PROMPTS
    from engine.tokenizer import load_tokenizer

    logging.basicConfig(level=logging.INFO)
    config = engine_config_from_args(args, "none")
    tokenizer = load_tokenizer(config.model)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]) for text in CALIBRATION_PROMPTS]
    calibration, path = run_calibration(config, prompts, args.max_new_tokens)
    print(f"PLD+ calibration: {calibration.ranking} ranking, hidden layer {calibration.layer}, "
          f"{len(calibration.heads)} heads; scores {calibration.scores}\nsaved to {path}")


def build_tables(args: argparse.Namespace) -> None:
    """Build (or find) every model-derived table for the model ARGS names, as `serve` would on first start."""
    import logging

    from engine.drafter_context import build_model_tables

    logging.basicConfig(level=logging.INFO)
    for name, path in build_model_tables(engine_config_from_args(args, "none").model).items():
        print(f"{name}: {path}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve(args)
    elif args.command == "tables":
        build_tables(args)
    elif args.command == "calibrate":
        calibrate_pld_plus(args)
    else:
        from bench.cli import run_bench

        run_bench(args, engine_config_from_args)


if __name__ == "__main__":
    sys.exit(main())
