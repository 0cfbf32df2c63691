"""The `specserve` command: `serve` (server/), `bench` (bench/) and `tables build` (model-derived drafter tables).

It lives beside the packages rather than in `server/`, so that the server never imports the
benchmark harness: this module is the one place that wires both.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    calibrate.add_argument("drafter", choices=("pld-plus", "sv"))
    calibrate.add_argument("--out", type=Path, default=None, help="sv: also write the Brier scores and information gain here")
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


def calibrate_sv(args: argparse.Namespace) -> None:
    """Profile the draft and companion models on the calibration prompts (engine/calibration_prompts.py: PLD+'s and
    short chat prompts, none from a benchmark set) and keep SV's acceptance table, greedy and sampled."""
    import json
    import logging

    from engine.calibration_prompts import CALIBRATION_PROMPTS, CHAT_PROMPTS
    from engine.companion import calibrate_sv as calibrate, sv_fingerprints, sv_table_path
    from engine.engine import Engine
    from engine.tokenizer import load_tokenizer

    logging.basicConfig(level=logging.INFO)
    config = engine_config_from_args(args, "none")
    if not (config.model.draft_model and config.model.companion_model):
        raise SystemExit("specserve calibrate sv needs --draft-model and --companion-model")
    tokenizer = load_tokenizer(config.model)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
               for text in CALIBRATION_PROMPTS + CHAT_PROMPTS]
    engine = Engine(config)
    fingerprints = sv_fingerprints(engine.model_fingerprint, engine.draft_model, engine.companion_model)
    reports = {}
    for greedy in (True, False):
        table, reports["greedy" if greedy else "sampled"] = calibrate(engine, prompts, args.max_new_tokens, greedy)
        path = sv_table_path(engine.cache_dir, fingerprints, greedy)
        table.save(path)
        print(f"SV table ({'greedy' if greedy else 'sampled'}, {table.meta['num_tokens']} tokens) saved to {path}")
    reports["command"] = "specserve " + " ".join(sys.argv[1:])
    print(json.dumps(reports, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(reports, indent=1))


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
        calibrate_sv(args) if args.drafter == "sv" else calibrate_pld_plus(args)
    else:
        from bench.cli import run_bench

        run_bench(args, engine_config_from_args)


if __name__ == "__main__":
    sys.exit(main())
