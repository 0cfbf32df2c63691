"""The `specserve` command: `serve` (server/), `calibrate` (engine/calibration/), `train-draft` (engine/training/)
and `bench` (bench/).

It lives beside the packages rather than in `server/`, so that the server never imports the benchmark harness
or the offline tools: this module is the one place that wires them. Each subcommand sets `run`, the function
its parsed flags go to.
"""
from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    # imported here, not at the top: the engine process a server spawns imports this module (it is the server's
    # __main__), and needs none of the commands' modules
    from bench.cli import add_bench_parser  # heavy: see the comment above
    from server.cli import add_serve_parser  # heavy: see the comment above

    parser = argparse.ArgumentParser(prog="specserve", description="Lossless speculative LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    add_calibrate_parser(commands)
    add_train_draft_parser(commands)
    add_bench_parser(commands)
    return parser


def add_calibrate_parser(commands) -> None:
    from engine.calibration import ARTIFACTS, CalibrationOptions  # heavy: see build_parser
    from server.cli import add_engine_flags  # heavy: see build_parser

    calibrate = commands.add_parser(
        "calibrate", help="build an artifact drafters derive from the served model, ahead of serving",
        description="bigram: the model bigram table of the ngram and spectra drafters; "
                    "pld-plus: PLD+'s layer and heads; "
                    "sv: Speculative Verification's acceptance tables (needs --draft-model and --companion-model); "
                    "corpus: SPECTRA-retrieval's corpus of the samples the model finds likeliest, and its table of "
                    "the model's own next tokens",
    )
    calibrate.add_argument("artifact", choices=tuple(ARTIFACTS))
    calibrate.add_argument("--out", type=Path, default=None,
                           help="sv: also write the Brier scores and information gain here")
    calibrate.add_argument("--max-new-tokens", type=int, default=CalibrationOptions.max_new_tokens,
                           help="tokens of each calibration answer")
    calibrate.add_argument("--corpus-keep", type=float, default=CalibrationOptions.corpus_keep,
                           help="corpus: the fraction of each source's samples kept, lowest perplexity first")
    calibrate.add_argument("--corpus-mib", type=int, default=CalibrationOptions.corpus_mib,
                           help="corpus: MiB of retrieval index the kept samples may fill")
    calibrate.add_argument("--corpus-sampled-prompts", type=int, default=CalibrationOptions.corpus_sampled_prompts,
                           help="corpus: training prompts answered at T = 1 for the table of the model's own "
                                "next tokens")
    calibrate.add_argument("--model-ngrams-mib", type=int, default=CalibrationOptions.model_ngrams_mib,
                           help="corpus: MiB the table of the model's own next tokens may fill")
    add_engine_flags(calibrate)
    calibrate.set_defaults(run=calibrate_artifact)


def calibrate_artifact(args: argparse.Namespace) -> None:
    from engine.calibration import ARTIFACTS, CalibrationOptions  # heavy: see build_parser
    from server.cli import engine_config  # heavy: see build_parser

    logging.basicConfig(level=logging.INFO)
    options = CalibrationOptions(args.max_new_tokens, args.out, "specserve " + shlex.join(sys.argv[1:]),
                                 args.corpus_keep, args.corpus_mib, args.corpus_sampled_prompts,
                                 args.model_ngrams_mib)
    ARTIFACTS[args.artifact](engine_config(args, "none"), options)


def add_train_draft_parser(commands) -> None:
    from engine.training import COMPANION, TrainOptions  # heavy: see build_parser
    from server.cli import add_engine_flags  # heavy: see build_parser

    train = commands.add_parser(
        "train-draft", help="train an EAGLE-3 draft head for the served model on this machine",
        description="The served model answers training prompts written for it (greedy and sampled); a head of one "
                    "layer learns from its hidden states by training-time test and is written in the public "
                    "EAGLE-3 layout, for --draft-model.",
    )
    defaults = TrainOptions(Path("."))
    train.add_argument("--out", type=Path, required=True, help="the head's folder (checkpoints under it)")
    train.add_argument("--num-prompts", type=int, default=defaults.num_prompts, help="training prompts answered")
    train.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens, help="tokens of each answer")
    train.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab,
                       help="draft vocabulary: the answer tokens seen most often")
    train.add_argument("--intermediate-size", type=int, default=None,
                       help=f"the head's MLP width (default {defaults.intermediate_size}; a companion's "
                            f"{COMPANION.intermediate_size})")
    train.add_argument("--epochs", type=int, default=defaults.epochs, help="passes over the training answers")
    train.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (AdamW, cosine)")
    train.add_argument("--ttt-steps", type=int, default=defaults.ttt_steps,
                       help="training-time test steps: drafted positions each answer is trained at")
    train.add_argument("--seed", type=int, default=None, help="prompts, sampled answers and training order "
                       f"(default {defaults.seed}; a companion's {COMPANION.seed})")
    train.add_argument("--init", type=Path, default=None,
                       help="a head's folder to train further instead of starting a new one (its draft vocabulary, "
                            "width and target layers are kept): another --seed gives it answers it has not seen")
    train.add_argument("--companion", action="store_true",
                       help="train the companion head Speculative Verification scores a draft head's tokens with "
                            "(--companion-model): narrower, and trained on the answers to other prompts")
    add_engine_flags(train)
    train.set_defaults(run=train_draft_head)


def train_draft_head(args: argparse.Namespace) -> None:
    from engine.training import COMPANION, TrainOptions, train_draft  # heavy: see build_parser
    from server.cli import engine_config  # heavy: see build_parser

    logging.basicConfig(level=logging.INFO)
    defaults = COMPANION if args.companion else TrainOptions(args.out)
    options = TrainOptions(
        args.out, args.num_prompts, args.max_new_tokens, args.draft_vocab,
        args.intermediate_size or defaults.intermediate_size, args.epochs, args.lr, args.ttt_steps,
        defaults.seed if args.seed is None else args.seed, "specserve " + shlex.join(sys.argv[1:]), args.init,
    )
    train_draft(engine_config(args, "none"), options)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
