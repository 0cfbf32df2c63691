"""`specserve bench NAME`: one subcommand per benchmark, each with its own flags, registered in BENCHMARKS.

Every benchmark takes the engine's flags (server/flags.py), `--max-new-tokens`, `--out` and `--data-dir`; a
benchmark's `add_flags` adds its own. Its `run` gets the parsed flags, the EngineConfig they describe (drafting
with `none`; `config.with_drafter` gives the others), the tokenizer and the output folder.
"""
from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.api import run_api_benchmark
from bench.concurrency import run_concurrency_benchmark, turn2_conversations
from bench.cpu_layouts import add_cpu_layouts_flags, run_cpu_layouts
from bench.data import MissingDataError, data_path, first_per_category, load_questions, missing_data_message
from bench.llama_server import LlamaServerRunner, start_llama_server
from bench.long_context import CONTEXTS, context_questions, definition_check, definition_markdown, long_code
from bench.models import MODES, run_models_benchmark
from bench.mt import run_mt_benchmark
from bench.ngram import DATASETS as NGRAM_DATASETS
from bench.ngram import run_ngram_benchmark
from bench.pld_plus import run_pld_plus_benchmark
from bench.replicas import add_replicas_flags, run_replicas
from bench.roofline import BATCH_SIZES as ROOFLINE_BATCH_SIZES
from bench.roofline import CPU_MT_RESULTS, VERIFY_TOKENS, run_roofline
from bench.roofline import SHAPES as ROOFLINE_SHAPES
from bench.routing_sim import add_routing_sim_flags, run_routing_sim
from bench.runners import EngineRunner, HFRunner
from bench.sessions import run_sessions_benchmark
from bench.soak import run_soak
from bench.spectra import run_spectra_benchmark
from bench.step_profile import run_step_profile
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model.model_loader import load_model
from engine.model.model_source import resolve_model_source
from engine.model.tokenizer import load_tokenizer
from server.cli import add_engine_flags, engine_config
from server.flags import config_as_argv

ALL_DRAFTERS = ("none", "copyspec", "ngram", "spectra", "hf-greedy", "hf-pld", "llama-server", "llama-server-spec")
PROMPT_LOOKUP_DRAFTERS = ("pld", "pld-plus")  # conversation benchmarks run them when named (bench spec-bench: always)
MODEL_DRAFTERS = ("draft", "copyspec+draft")  # the draft model (the shipped head by default): run when named
PEERS = ("transformers-serve", "llama-server", "llama-server-spec")
SESSION_MODES = ("off", "explicit", "implicit", "responses")  # responses: previous_response_id (bench/sessions)
DEFAULT_SESSION_MODES = ("off", "explicit", "implicit")
SESSION_BENCHMARKS = ("mt-redundant", "self-correction")
SESSION_DRAFTERS = ("none", "copyspec")  # the drafters `bench sessions` applies; the HTTP server has no hf-* peers
API_VARIANTS = ("plain", "logprobs", "penalties", "repetition_penalty", "logit_bias", "json_schema", "tool_call")


@dataclass(frozen=True)
class Benchmark:
    help: str
    run: Callable[[argparse.Namespace, EngineConfig, object, Path], None]  # (args, config, tokenizer, out folder)
    data_sets: Callable[[argparse.Namespace], list[str]]  # the data files it reads, checked before any model loads
    add_flags: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    results_dir: str | None = None  # bench/results/ folder, when not the benchmark's name
    serves_model: bool = True  # False: it builds its own models (no tokenizer of the served model is loaded)


def comma_list(
    allowed: tuple[str, ...], first: str | None = None, what: str = "values", may_be_empty: bool = False,
) -> Callable[[str], tuple]:
    """An argparse type: a comma list of ALLOWED names, FIRST (when given) always in it and first; '' an empty list
    where MAY_BE_EMPTY (no peers)."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        if not set(names) <= set(allowed) or (not names and first is None and not may_be_empty):
            raise argparse.ArgumentTypeError(f"{what} are {allowed}")
        return (first, *(n for n in names if n != first)) if first else names
    return parse


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def parse_turns(text: str) -> tuple[int, ...]:
    turns = tuple(int(t) for t in text.split(","))
    if not set(turns) <= {1, 2}:
        raise argparse.ArgumentTypeError("turns are 1 and/or 2")
    return turns


def add_drafters_flag(
    parser: argparse.ArgumentParser, allowed: tuple[str, ...] = ALL_DRAFTERS, extra: tuple[str, ...] = (),
) -> None:
    """--drafters: a comma list from ALLOWED and EXTRA, by default every one of ALLOWED."""
    parser.add_argument("--drafters", type=comma_list(allowed + extra, "none", "drafters"),
                        default=("none", *allowed[1:]), help=f"comma list from {allowed + extra}; 'none' is always run")


def add_limit_flag(parser: argparse.ArgumentParser, default_note: str = "all") -> None:
    parser.add_argument("--limit", type=int, default=None, help=f"first N questions only (default: {default_note})")


# --- conversations, turn by turn: mt-redundant, mt-bench, humaneval, gsm8k ----------------------------------------
def add_mt_flags(parser: argparse.ArgumentParser) -> None:
    add_drafters_flag(parser, extra=PROMPT_LOOKUP_DRAFTERS + MODEL_DRAFTERS)
    add_limit_flag(parser)
    parser.add_argument("--per-category", type=int, default=None, help="first N questions of each category")
    parser.add_argument("--resume", action="store_true", help="keep rows already in OUT/results.json")
    parser.add_argument("--peer-turns", type=parse_turns, default=(1, 2), help="turns the hf-* peers answer, e.g. 2")
    parser.add_argument("--max-turns", type=int, default=2, help="answer at most this many turns")
    parser.add_argument("--completions", action="store_true",
                        help="continue each question's text with no chat template, as a base model is used "
                             "(humaneval: the function's signature and docstring)")


def mt_benchmark(name: str) -> Benchmark:
    def run(args: argparse.Namespace, config: EngineConfig, tokenizer, out_dir: Path) -> None:
        questions = first_per_category(load_questions(name, args.data_dir), args.per_category)[: args.limit]
        if args.completions and any("completion" not in q for q in questions):
            raise SystemExit(f"--completions needs a data set with text to continue (humaneval), not {name}")
        with mt_runners(args, config, out_dir) as runners:
            run_mt_benchmark(name, questions, runners, tokenizer, runners["none"].engine.runner.model, args, out_dir)

    return Benchmark(f"{name}: tokens/s per drafter, conversation by conversation", run, lambda args: [name],
                     add_mt_flags)


@contextmanager
def mt_runners(args: argparse.Namespace, config: EngineConfig, out_dir: Path) -> Iterator[dict]:
    """A runner per drafter of ARGS (specserve engines, transformers' generate, llama-server), closed on leaving."""
    runners, hf_model = {}, None
    try:
        for drafter in args.drafters:
            if drafter.startswith("hf-"):
                hf_model = hf_model or load_model(config.model)
                runners[drafter] = HFRunner(hf_model, prompt_lookup=drafter == "hf-pld")
            elif drafter.startswith("llama-server"):
                runners[drafter] = llama_server_runner(args, drafter, out_dir)
            else:
                runners[drafter] = EngineRunner(Engine(config.with_drafter(drafter)))
        yield runners
    finally:
        for runner in runners.values():
            if hasattr(runner, "close"):
                runner.close()


def add_long_context_flags(parser: argparse.ArgumentParser) -> None:
    add_mt_flags(parser)
    parser.add_argument("--contexts", type=parse_ints, default=CONTEXTS, help="context lengths in tokens")
    parser.add_argument("--definition-tokens", type=int, default=40,
                        help="tokens per context checked against transformers' eager float32 forward (0: none)")


def run_long_context(args: argparse.Namespace, config: EngineConfig, tokenizer, out_dir: Path) -> None:
    """A long Python file continued from each context length; then the definition check (bench/long_context.py)."""
    args.completions, args.max_turns = True, 1
    questions = context_questions(tokenizer, long_code(args.data_dir), args.contexts)
    with mt_runners(args, config, out_dir) as runners:
        run_mt_benchmark("long-context", questions, runners, tokenizer, runners["none"].engine.runner.model, args,
                         out_dir)
    if args.definition_tokens:
        rows = definition_check(config, questions, tokenizer, args.definition_tokens)
        results = json.loads((out_dir / "results.json").read_text())
        (out_dir / "results.json").write_text(json.dumps({**results, "definition": rows}, indent=1))
        with open(out_dir / "results.md", "a") as report:
            report.write(definition_markdown(rows))


def llama_server_runner(args: argparse.Namespace, name: str, out_dir: Path) -> LlamaServerRunner:
    """llama-server on the same GGUF, one slot (single stream), plain or with its own speculation."""
    source = resolve_model_source(args.model)
    if source.gguf_file is None:
        raise SystemExit("llama-server rows need a GGUF model (--model FILE.gguf, or the embedded default)")
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = str(Path(source.path) / source.gguf_file)
    return LlamaServerRunner(
        start_llama_server(gguf_path, name.endswith("-spec"), out_dir, threads=args.num_threads or 2)
    )


# --- HTTP servers under load: concurrency, sessions, api ------------------------------------------------------------
def add_concurrency_flags(parser: argparse.ArgumentParser) -> None:
    add_drafters_flag(parser, tuple(d for d in ALL_DRAFTERS if not d.startswith("hf-")))
    add_limit_flag(parser)
    parser.add_argument("--concurrency", type=parse_ints, default=(1, 4, 16, 32, 64),
                        help="client counts, in order; one named again is measured again (a round) on the next "
                             "conversations, and its ratios pool the rounds")
    parser.add_argument("--requests-per-client", type=int, default=2, help="turn-2 requests per client and level")
    parser.add_argument("--peers", type=comma_list(PEERS, what="peers", may_be_empty=True), default=PEERS[:1],
                        help=f"peer servers from {PEERS}, or ''")
    parser.add_argument("--warm-prompts", action="store_true",
                        help="every server caches every prompt first (specserve: sessions on, a fresh session per "
                             "request, so prompt KV is reused and no drafter state is); default: sessions off")
    parser.add_argument("--completions", action="store_true",
                        help="HumanEval's prompts completed through /v1/completions, no chat template (base models); "
                             "default: MT-Redundant's turn 2 through /v1/chat/completions")
    parser.add_argument("--peer-kv-blocks", type=int, default=None,
                        help="transformers serve's KV blocks of 256 tokens (default: enough for the largest C at once)")
    parser.add_argument("--peer-max-batch-tokens", type=int, default=None,
                        help="transformers serve's tokens per forward (default: specserve's per-step budget, 512)")


def run_concurrency(args: argparse.Namespace, config: EngineConfig, tokenizer, out_dir: Path) -> None:
    """HTTP servers under C concurrent clients; specserve per drafter and the peers."""
    # Levels cycle through the conversations, so a later one may replay an earlier one's: unless every server caches
    # every prompt first (--warm-prompts), a session cache would turn those into hits the peers never get.
    engine_flags = specserve_engine_flags(config) + ["--session-mode", "implicit" if args.warm_prompts else "off"]
    if args.completions:
        conversations = [q["completion"] for q in load_questions("humaneval", args.data_dir)[: args.limit]]
    else:
        questions = load_questions("mt-redundant", args.data_dir)[: args.limit]
        baseline = EngineRunner(Engine(config))
        conversations = turn2_conversations(questions, tokenizer, baseline, args.max_new_tokens)
        del baseline  # its KV pool would sit beside every server under test
        gc.collect()
    run_concurrency_benchmark(args, list(args.drafters), conversations, tokenizer, engine_flags, out_dir)


def specserve_engine_flags(config: EngineConfig) -> list[str]:
    """CONFIG as `specserve serve` flags, for every server a benchmark starts (each names its own --drafter)."""
    return config_as_argv(config, skip=("drafter",))


def add_sessions_flags(parser: argparse.ArgumentParser) -> None:
    add_drafters_flag(parser, SESSION_DRAFTERS)
    add_limit_flag(parser)
    parser.add_argument("--session-modes", type=comma_list(SESSION_MODES, "off", "session modes"),
                        default=DEFAULT_SESSION_MODES,
                        help=f"comma list from {SESSION_MODES} (default {','.join(DEFAULT_SESSION_MODES)}); "
                             "'off' is always run. One specserve per mode and "
                             "drafter, all up at once: --kv-cache-memory is each one's (1 GiB fits the default 6 in "
                             "24 GB)")
    parser.add_argument("--benchmarks", type=comma_list(SESSION_BENCHMARKS, what="benchmarks"),
                        default=SESSION_BENCHMARKS, help=f"comma list from {SESSION_BENCHMARKS}")
    parser.add_argument("--self-correction-limit", type=int, default=20, help="first N math_reasoning items")


def run_sessions(args: argparse.Namespace, config: EngineConfig, tokenizer, out_dir: Path) -> None:
    """Multi-turn conversations through HTTP servers, per session mode and drafter."""
    run_sessions_benchmark(args, list(args.drafters), specserve_engine_flags(config), out_dir)


def sessions_data(args: argparse.Namespace) -> list[str]:
    return [{"mt-redundant": "mt-redundant", "self-correction": "spec-bench"}[b] for b in args.benchmarks]


def add_api_flags(parser: argparse.ArgumentParser) -> None:
    add_limit_flag(parser, "8")
    parser.add_argument("--variants", type=comma_list(API_VARIANTS, what="variants"), default=API_VARIANTS,
                        help=f"comma list of request-field variants from {API_VARIANTS}")


def run_api(args: argparse.Namespace, config: EngineConfig, tokenizer, out_dir: Path) -> None:
    """MT-Redundant turn 2 with each request-field variant, through specserve with drafter none and copyspec; a copyspec
    output that differs from none's fails the command once the table is out."""
    results = run_api_benchmark(args, specserve_engine_flags(config), tokenizer, out_dir)
    if results["mismatches"]:
        print((out_dir / "results.md").read_text())
        raise SystemExit(f"lossless check failed: {len(results['mismatches'])} copyspec outputs differ from none's "
                         f"(see {out_dir / 'results.md'})")


# --- the rest -------------------------------------------------------------------------------------------------------
def add_ngram_flags(parser: argparse.ArgumentParser) -> None:
    add_limit_flag(parser, "20")
    parser.add_argument("--grid-limit", type=int, default=5, help="questions per set of the k x w grid (0: no grid)")
    parser.add_argument("--grid-max-new-tokens", type=int, default=96, help="new tokens per grid generation")


def add_spectra_flags(parser: argparse.ArgumentParser) -> None:
    add_limit_flag(parser, "10")
    parser.add_argument("--grid-limit", type=int, default=3,
                        help="questions per set of the ablation, each component taken away in turn (0: none)")
    parser.add_argument("--planner-off-limit", type=int, default=3,
                        help="questions per set with the planner off, for the paper's tokens per call (0: none)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every run (0: greedy, outputs compared with none's)")
    parser.add_argument("--agentic", type=int, default=40,
                        help="requests of the agentic run: separate conversations whose answers repeat (0: none)")


def add_models_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=parse_ints, default=(1, 4, 16, 32, 64), help="batch sizes B")
    parser.add_argument("--modes", type=comma_list(tuple(MODES), "none", "modes"), default=tuple(MODES),
                        help="comma list of the modes to run ('none' always runs; default: all)")
    parser.add_argument("--min-requests", type=int, default=16,
                        help="rounds of B requests at each batch size B until at least this many were answered")


def add_roofline_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=comma_list(tuple(ROOFLINE_SHAPES), what="sizes"), default=("1b", "8b"),
                        help=f"model shapes from {tuple(ROOFLINE_SHAPES)} (tiny: a check of the benchmark on a CPU)")
    parser.add_argument("--batch-sizes", type=parse_ints, default=ROOFLINE_BATCH_SIZES, help="batch sizes B")
    parser.add_argument("--verify-tokens", type=parse_ints, default=VERIFY_TOKENS,
                        help="new tokens per request of the verify steps (1 must be among them)")
    parser.add_argument("--hf-batch-sizes", type=parse_ints, default=(1,),
                        help="batch sizes at which transformers' generate is measured (each compiles its own graphs)")
    parser.add_argument("--graph-max-tokens", type=int, default=CacheConfig.cuda_graph_max_tokens,
                        help="the largest step specserve's runner captures as a CUDA graph (0: none)")
    parser.add_argument("--no-hf-compile", dest="hf_compile", action="store_false",
                        help="transformers' generate uncompiled (on a CPU it always is)")
    parser.add_argument("--cpu-mt-results", type=Path, default=CPU_MT_RESULTS,
                        help="the CPU MT-Redundant results whose copyspec acceptance the projection uses")
    parser.add_argument("--device-mt-results", type=Path, default=None,
                        help="measure nothing: join this MT-Redundant run's turn-2 rows (the default model on the same "
                             "device) into OUT's results")


def run_roofline_bench(args: argparse.Namespace, config: EngineConfig, tokenizer, out_dir: Path) -> None:
    if 1 not in args.verify_tokens:
        raise SystemExit("--verify-tokens must include 1: every cost is relative to it")
    run_roofline(args, config.model.device, out_dir)


def add_soak_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--soak-clients", type=int, default=64, help="concurrent streaming clients")
    parser.add_argument("--soak-seconds", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients' random requests")


BENCHMARKS: dict[str, Benchmark] = {
    **{name: mt_benchmark(name) for name in ("mt-redundant", "mt-bench", "humaneval", "gsm8k")},
    "long-context": Benchmark("a long Python file continued past a sliding window, and the definition check there",
                              run_long_context, lambda args: ["humaneval"], add_long_context_flags),
    "spec-bench": Benchmark(
        "prompt lookup and PLD+ on Spec-Bench, with PLD+'s ablations",
        run_pld_plus_benchmark,
        lambda args: ["spec-bench", "mt-redundant"], lambda parser: add_limit_flag(parser, "20"), "pld-plus",
    ),
    "ngram": Benchmark("learning-free n-grams: the headline runs and the k x w grid", run_ngram_benchmark,
                       lambda args: list(NGRAM_DATASETS), add_ngram_flags),
    "spectra": Benchmark("SPECTRA: the headline runs and the ablation of its components", run_spectra_benchmark,
                         lambda args: list(NGRAM_DATASETS), add_spectra_flags),
    "concurrency": Benchmark("HTTP servers under C concurrent clients, specserve and peers", run_concurrency,
                             lambda args: ["humaneval" if args.completions else "mt-redundant"],
                             add_concurrency_flags),
    "sessions": Benchmark("multi-turn conversations per session mode", run_sessions, sessions_data, add_sessions_flags),
    "replicas": Benchmark("replicas behind the Shepherd Model Gateway: session hits, first tokens, a replica killed",
                          run_replicas, lambda args: ["mt-redundant"], add_replicas_flags, serves_model=False),
    "routing-sim": Benchmark("the router in front of many simulated replicas: hit rate and load as replicas change",
                             run_routing_sim, lambda args: [], add_routing_sim_flags, serves_model=False),
    "step-profile": Benchmark("where a step's time goes", run_step_profile, lambda args: ["mt-redundant"]),
    "cpu-layouts": Benchmark("forward time of a CPU memory layout (KV pool, weight scales) or kernel variant (AMX) "
                             "against the one it replaced",
                             run_cpu_layouts, lambda args: [], add_cpu_layouts_flags),
    "soak": Benchmark("streaming clients against one server for minutes: memory and errors",
                      lambda args, config, tokenizer, out: run_soak(args, out), lambda args: [], add_soak_flags),
    "api": Benchmark("request-field variants under speculation, with the lossless check", run_api,
                     lambda args: ["mt-redundant"], add_api_flags),
    "roofline": Benchmark("random Llama 1B/8B on a GPU: decode step against the memory-bandwidth bound, verify cost",
                          run_roofline_bench, lambda args: [], add_roofline_flags, "gpu", serves_model=False),
    "models": Benchmark("draft and companion models against plain decoding at batch sizes B", run_models_benchmark,
                        lambda args: ["mt-bench", "mt-redundant"], add_models_flags),
}


def add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="measure speed side by side (results under bench/results/NAME)")
    names = bench.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, benchmark in BENCHMARKS.items():
        parser = names.add_parser(name, help=benchmark.help, description=benchmark.help)
        add_engine_flags(parser)
        parser.add_argument("--max-new-tokens", type=int, default=256)
        parser.add_argument("--out", type=Path, default=None, help=f"output folder (default: bench/results/{name})")
        parser.add_argument("--data-dir", type=Path, default=None, help="folder with the benchmark data files")
        benchmark.add_flags(parser)
        parser.set_defaults(run=run_bench)


def check_data(benchmark: Benchmark, args: argparse.Namespace) -> None:
    """Stop before any model loads when a data file is missing, with a message that says what to fetch."""
    missing = []
    for name in benchmark.data_sets(args):
        try:
            data_path(name, args.data_dir)
        except MissingDataError:
            missing.append(name)
    if missing:
        raise SystemExit(missing_data_message(missing, args.data_dir))


def run_bench(args: argparse.Namespace) -> None:
    benchmark = BENCHMARKS[args.name]
    check_data(benchmark, args)
    out_dir = args.out or Path(__file__).resolve().parent / "results" / (benchmark.results_dir or args.name)
    config = engine_config(args, "none")
    benchmark.run(args, config, load_tokenizer(config.model) if benchmark.serves_model else None, out_dir)
    print((out_dir / "results.md").read_text())
