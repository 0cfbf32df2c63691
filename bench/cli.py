"""`specserve bench NAME`: builds the generators and runs a benchmark."""
from __future__ import annotations

import argparse
import gc
from pathlib import Path

from bench.data import MissingDataError, data_path, first_per_category, load_questions, missing_data_message

MT_BENCHMARKS = ("mt-redundant", "mt-bench", "humaneval", "gsm8k")  # conversations, turn by turn
RESULTS_DIRS = {"spec-bench": "pld-plus"}  # bench/results/ folder of a benchmark not named after its data set
ALL_DRAFTERS = ("none", "copyspec", "ngram", "hf-greedy", "hf-pld", "llama-server", "llama-server-spec")
PEERS = ("transformers-serve", "llama-server", "llama-server-spec")
SESSION_MODES = ("off", "explicit", "implicit")
SESSION_BENCHMARKS = ("mt-redundant", "self-correction")
SESSION_DRAFTERS = ("none", "copyspec")  # the drafters `bench sessions` applies; the HTTP server has no hf-* peers
API_VARIANTS = ("plain", "logprobs", "penalties", "repetition_penalty", "logit_bias", "json_schema", "tool_call")


def add_bench_parser(commands, add_engine_flags) -> None:
    bench = commands.add_parser("bench", help="measure speed side by side (results under bench/results/NAME)")
    bench.add_argument("name", choices=(*MT_BENCHMARKS, "spec-bench", "ngram", "concurrency", "sessions", "step-profile", "soak", "api", "models"))
    add_engine_flags(bench)
    bench.add_argument("--drafters", default=",".join(ALL_DRAFTERS), help=f"comma list from {ALL_DRAFTERS}; 'none' is always run")
    bench.add_argument("--limit", type=int, default=None, help="first N questions only (api: default 8)")
    bench.add_argument("--per-category", type=int, default=None, help="mt-bench, mt-redundant: first N questions of each category")
    bench.add_argument("--max-new-tokens", type=int, default=256)
    bench.add_argument("--out", type=Path, default=None, help="output folder (default bench/results/NAME)")
    bench.add_argument("--data-dir", type=Path, default=None, help="folder with the benchmark data files (default: ../shared/data beside the checkout)")
    bench.add_argument("--resume", action="store_true", help="keep rows already in OUT/results.json")
    bench.add_argument("--peer-turns", type=parse_turns, default=(1, 2), help="turns the hf-* peers answer, e.g. 2")
    bench.add_argument("--max-turns", type=int, default=2, help="conversations: answer at most this many turns")
    bench.add_argument("--grid-limit", type=int, default=5, help="ngram: questions per set of the k x w grid (0: no grid)")
    bench.add_argument("--grid-max-new-tokens", type=int, default=96, help="ngram: new tokens per grid generation")
    bench.add_argument("--concurrency", type=parse_ints, default=(1, 4, 16, 32, 64), help="concurrency: client counts")
    bench.add_argument("--modes", type=parse_model_modes, default=None,
                       help="models: comma list of the modes to run ('none' always runs; default: all)")
    bench.add_argument("--min-requests", type=int, default=16,
                       help="models: rounds of B requests at each batch size B until at least this many were answered")
    bench.add_argument("--requests-per-client", type=int, default=2, help="concurrency: turn-2 requests per client and level")
    bench.add_argument("--peers", type=parse_peers, default=PEERS[:1], help=f"concurrency: peer servers from {PEERS}, or ''")
    bench.add_argument("--warm-prompts", action="store_true",
                       help="concurrency: every server caches every prompt first (specserve: sessions on, a fresh session "
                            "per request, so prompt KV is reused and no drafter state is); default: sessions off")
    bench.add_argument("--peer-kv-blocks", type=int, default=None,
                       help="concurrency: transformers serve's KV blocks of 256 tokens (default: enough for the largest C at once)")
    bench.add_argument("--peer-max-batch-tokens", type=int, default=None,
                       help="concurrency: transformers serve's tokens per forward (default: specserve's per-step budget, 512)")
    bench.add_argument("--session-modes", type=parse_session_modes, default=SESSION_MODES,
                       help=f"sessions: comma list from {SESSION_MODES}; 'off' is always run. One specserve per mode and "
                            "drafter, all up at once: --kv-cache-memory is each one's (1 GiB fits the default 6 in 24 GB)")
    bench.add_argument("--benchmarks", type=parse_session_benchmarks, default=SESSION_BENCHMARKS,
                       help=f"sessions: comma list from {SESSION_BENCHMARKS}")
    bench.add_argument("--soak-clients", type=int, default=64, help="soak: concurrent streaming clients")
    bench.add_argument("--soak-seconds", type=float, default=300.0, help="soak: seconds of load")
    bench.add_argument("--seed", type=int, default=0, help="soak: seed of the clients' random requests")
    bench.add_argument("--self-correction-limit", type=int, default=20, help="sessions: first N math_reasoning items")
    bench.add_argument("--variants", type=parse_api_variants, default=API_VARIANTS,
                       help=f"api: comma list of request-field variants from {API_VARIANTS}")


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def parse_peers(text: str) -> tuple[str, ...]:
    peers = tuple(p.strip() for p in text.split(",") if p.strip())
    if not set(peers) <= set(PEERS):
        raise argparse.ArgumentTypeError(f"peers are {PEERS}")
    return peers


def parse_model_modes(text: str) -> tuple[str, ...]:
    from bench.models import MODES

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not set(modes) <= set(MODES):
        raise argparse.ArgumentTypeError(f"modes are {tuple(MODES)}")
    return ("none", *(m for m in modes if m != "none"))


def parse_turns(text: str) -> tuple[int, ...]:
    turns = tuple(int(t) for t in text.split(","))
    if not set(turns) <= {1, 2}:
        raise argparse.ArgumentTypeError("turns are 1 and/or 2")
    return turns


def parse_session_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not set(modes) <= set(SESSION_MODES):
        raise argparse.ArgumentTypeError(f"session modes are {SESSION_MODES}")
    return ("off", *dict.fromkeys(m for m in modes if m != "off"))


def parse_session_benchmarks(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names or not set(names) <= set(SESSION_BENCHMARKS):
        raise argparse.ArgumentTypeError(f"benchmarks are {SESSION_BENCHMARKS}")
    return names


def parse_api_variants(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names or not set(names) <= set(API_VARIANTS):
        raise argparse.ArgumentTypeError(f"variants are {API_VARIANTS}")
    return names


def parse_drafters(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ALL_DRAFTERS))
    if unknown:
        raise SystemExit(f"unknown drafters {unknown}; choose from {ALL_DRAFTERS}")
    return ["none"] + [n for n in names if n != "none"]


def data_sets_needed(args: argparse.Namespace) -> list[str]:
    """The data sets benchmark ARGS.name reads."""
    if args.name == "soak":
        return []
    if args.name == "sessions":
        return [{"mt-redundant": "mt-redundant", "self-correction": "spec-bench"}[b] for b in args.benchmarks]
    if args.name == "ngram":
        from bench.ngram import DATASETS

        return list(DATASETS)
    if args.name in ("concurrency", "step-profile", "api"):
        return ["mt-redundant"]
    if args.name == "models":
        return ["mt-bench", "mt-redundant"]
    if args.name == "spec-bench":
        return ["spec-bench", "mt-redundant"]
    return [args.name]


def check_data(args: argparse.Namespace) -> None:
    """Stop before any model loads when a data file is missing, with a message that says what to fetch."""
    missing = []
    for name in data_sets_needed(args):
        try:
            data_path(name, args.data_dir)
        except MissingDataError:
            missing.append(name)
    if missing:
        raise SystemExit(missing_data_message(missing, args.data_dir))


def run_bench(args: argparse.Namespace, engine_config_from_args) -> None:
    from engine.tokenizer import load_tokenizer

    check_data(args)
    out_dir = args.out or Path(__file__).resolve().parent / "results" / RESULTS_DIRS.get(args.name, args.name)
    if args.name == "soak":
        from bench.soak import run_soak

        run_soak(args, out_dir)
        print((out_dir / "results.md").read_text())
        return
    tokenizer = load_tokenizer(engine_config_from_args(args, "none").model)
    if args.name == "concurrency":
        run_concurrency(args, engine_config_from_args, tokenizer, out_dir)
    elif args.name == "ngram":
        from bench.ngram import run_ngram_benchmark

        run_ngram_benchmark(args, engine_config_from_args, tokenizer, out_dir)
    elif args.name == "spec-bench":
        from bench.pld_plus import run_pld_plus_benchmark

        run_pld_plus_benchmark(args, engine_config_from_args, tokenizer, out_dir)
    elif args.name == "step-profile":
        from bench.step_profile import run_step_profile

        run_step_profile(args, engine_config_from_args, tokenizer, out_dir)
    elif args.name == "sessions":
        run_sessions(args, out_dir)
    elif args.name == "api":
        run_api(args, tokenizer, out_dir)
    elif args.name == "models":
        from bench.models import run_models_benchmark

        run_models_benchmark(args, engine_config_from_args, tokenizer, out_dir)
    else:
        run_mt(args, engine_config_from_args, tokenizer, out_dir)
    print((out_dir / "results.md").read_text())


def run_mt(args: argparse.Namespace, engine_config_from_args, tokenizer, out_dir: Path) -> None:
    from bench.mt import run_mt_benchmark
    from bench.runners import EngineRunner, HFRunner
    from engine.engine import Engine
    from engine.model_loader import load_model

    runners, hf_model = {}, None
    try:
        for name in parse_drafters(args.drafters):
            if name.startswith("hf-"):
                hf_model = hf_model or load_model(engine_config_from_args(args, "none").model)
                runners[name] = HFRunner(hf_model, prompt_lookup=name == "hf-pld")
            elif name.startswith("llama-server"):
                runners[name] = llama_server_runner(args, name, out_dir)
            else:
                runners[name] = EngineRunner(Engine(engine_config_from_args(args, name)))
        reference_model = runners["none"].engine.runner.model
        questions = first_per_category(load_questions(args.name, args.data_dir), args.per_category)[: args.limit]
        run_mt_benchmark(args.name, questions, runners, tokenizer, reference_model, args, out_dir)
    finally:
        for runner in runners.values():
            if hasattr(runner, "close"):
                runner.close()


def llama_server_runner(args: argparse.Namespace, name: str, out_dir: Path):
    """llama-server on the same GGUF, one slot (single stream), plain or with its own speculation."""
    from bench.llama_server import LlamaServerRunner, start_llama_server
    from engine.model_source import resolve_model_source

    source = resolve_model_source(args.model)
    if source.gguf_file is None:
        raise SystemExit("llama-server rows need a GGUF model (--model FILE.gguf, or the embedded default)")
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = str(Path(source.path) / source.gguf_file)
    return LlamaServerRunner(start_llama_server(gguf_path, name.endswith("-spec"), out_dir, threads=args.num_threads or 2))


def run_concurrency(args: argparse.Namespace, engine_config_from_args, tokenizer, out_dir: Path) -> None:
    """HTTP servers under C concurrent clients; specserve per drafter (hf-* drafters do not apply) and peers."""
    from bench.concurrency import run_concurrency_benchmark, turn2_conversations
    from bench.runners import EngineRunner
    from engine.engine import Engine

    args.concurrency_drafters = [d for d in parse_drafters(args.drafters) if not d.startswith("hf-")]
    # Every level replays the same conversations: unless every server caches every prompt first (--warm-prompts), a
    # session cache would turn later levels into hits the peers never get.
    engine_flags = specserve_engine_flags(args) + ["--session-mode", "implicit" if args.warm_prompts else "off"]
    questions = load_questions("mt-redundant", args.data_dir)[: args.limit]
    baseline = EngineRunner(Engine(engine_config_from_args(args, "none")))
    conversations = turn2_conversations(questions, tokenizer, baseline, args.max_new_tokens)
    del baseline  # its KV pool would sit beside every server under test
    gc.collect()
    run_concurrency_benchmark(args, conversations, tokenizer, engine_flags, out_dir)


def specserve_engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of ARGS as `specserve serve` arguments, for every server a benchmark starts."""
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
             "--device", args.device, "--dtype", args.dtype, "--weights", args.weights]
    for flag in ("model", "num_threads", "max_model_len", "max_num_batched_tokens", "kv_cache_memory", "block_size",
                 "attention_backend", "copy_gamma", "copy_max_tokens", "ngram_k", "ngram_w", "cache_dir", "session_ttl",
                 "max_sessions"):
        if getattr(args, flag, None) is not None:
            flags += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if getattr(args, "no_goodput_planner", False):
        flags.append("--no-goodput-planner")
    return flags


def run_api(args: argparse.Namespace, tokenizer, out_dir: Path) -> None:
    """MT-Redundant turn 2 with each request-field variant, through specserve with drafter none and copyspec; a copyspec
    output that differs from none's fails the command once the table is out."""
    from bench.api import run_api_benchmark

    results = run_api_benchmark(args, specserve_engine_flags(args), tokenizer, out_dir)
    if results["mismatches"]:
        print((out_dir / "results.md").read_text())
        raise SystemExit(f"lossless check failed: {len(results['mismatches'])} copyspec outputs differ from none's "
                         f"(see {out_dir / 'results.md'})")


def run_sessions(args: argparse.Namespace, out_dir: Path) -> None:
    """Multi-turn conversations through HTTP servers, per session mode and drafter (none and copyspec apply)."""
    from bench.sessions import run_sessions_benchmark

    args.session_drafters = [d for d in parse_drafters(args.drafters) if d in SESSION_DRAFTERS]
    run_sessions_benchmark(args, specserve_engine_flags(args), out_dir)
