"""`specserve serve`: flags in, one Config out. The engine flags are shared with `specserve bench` (bench/cli.py);
the `specserve` command itself (specserve.py) wires the two."""
from __future__ import annotations

import argparse
import os

from drafters.config import PLD_PLUS_RANKINGS, SpecConfig
from drafters.registry import DRAFTER_NAMES
from engine.config import ATTENTION_BACKENDS, DEVICES, DTYPES, WEIGHT_MODES, CacheConfig, EngineConfig, ModelConfig
from scheduler.config import SESSION_MODES, SchedulerConfig, SessionConfig
from server.auth import API_KEY_ENV
from server.config import Config, ServerConfig


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model id, local directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", choices=DEVICES, default="auto")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="the model's dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument(
        "--weights", choices=WEIGHT_MODES, default="auto",
        help="how Linear layers keep their weights on the CPU: float32, bfloat16, int8 or int4 (weight-only kernels; "
             "a GGUF's Q4 blocks map onto int4 directly), or w4a8 (the GGUF's blocks with activations rounded to 8 bits, "
             "multiplied in integers as llama.cpp does; AVX512-VNNI). auto: w4a8, else int4, for a Q4 GGUF on an "
             "AVX-512 CPU, else float32",
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="context length in tokens")
    parser.add_argument("--trust-remote-code", action="store_true", help="let transformers run the model repo's own code")
    parser.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument("--kv-cache-memory", type=float, default=CacheConfig.kv_cache_memory_gib, help="GiB of memory for the paged KV pool")
    parser.add_argument("--block-size", type=int, default=None, help="positions per KV block (default 16; 256 with flash-attn)")
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto", help="flash needs CUDA and flash-attn")
    parser.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs, help="requests running at once")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
        help="token budget of one step: prefill chunks, last tokens and drafts",
    )
    parser.add_argument("--max-waiting", type=int, default=SchedulerConfig.max_waiting, help="queued requests before 429")
    parser.add_argument("--no-goodput-planner", action="store_true", help="verify every drafted token")
    parser.add_argument("--copy-gamma", type=int, default=SpecConfig.copy_gamma, help="CopySpec match length γ")
    parser.add_argument("--copy-max-tokens", type=int, default=SpecConfig.copy_max_tokens, help="CopySpec tokens copied per match |S|")
    parser.add_argument("--ngram-k", type=int, default=SpecConfig.ngram_k, help="n-grams: candidate rows per draft, merged into one tree")
    parser.add_argument("--ngram-w", type=int, default=SpecConfig.ngram_w, help="n-grams: tokens per candidate row")
    parser.add_argument("--pld-num-tokens", type=int, default=SpecConfig.pld_num_tokens, help="prompt lookup: tokens copied after a match (K)")
    parser.add_argument("--pld-plus-ranking", choices=PLD_PLUS_RANKINGS, default=SpecConfig.pld_plus_ranking,
                        help="PLD+: rank copy sources by hidden states or induction-head attention (auto: the calibration's choice)")
    parser.add_argument("--pld-plus-max-tokens", type=int, default=SpecConfig.pld_plus_max_tokens, help="PLD+: tokens copied (K)")
    parser.add_argument("--pld-plus-layer", type=int, default=None, help="PLD+(h): hidden-state layer (default: calibrated)")
    parser.add_argument("--pld-plus-num-heads", type=int, default=None, help="PLD+(a): how many calibrated heads (default: calibrated)")
    parser.add_argument(
        "--draft-model", default=None,
        help="a draft model for --drafter draft / copyspec+draft: early-exit:N (the target's first N layers and its LM head, "
             "sharing its weights and KV) or what --model takes (same vocabulary as the target)",
    )
    parser.add_argument(
        "--companion-model", default=None,
        help="Speculative Verification's companion (the same forms as --draft-model): scores each drafted token so that "
             "the goodput planner verifies the ones worth it; its table comes from `specserve calibrate sv`",
    )
    parser.add_argument("--num-draft-tokens", type=int, default=SpecConfig.num_draft_tokens,
                        help="draft model: tokens drafted per step at most (the goodput planner may draft fewer)")
    parser.add_argument("--cache-dir", default=None, help="where tables derived from the model are kept (default: $XDG_CACHE_HOME/specserve)")
    parser.add_argument(
        "--session-mode", choices=SESSION_MODES, default=SessionConfig.mode,
        help="multi-turn session caches: implicit (X-Session-ID / session_id, else the longest cached prefix), "
             "explicit (named sessions only) or off",
    )
    parser.add_argument("--session-ttl", type=float, default=SessionConfig.ttl_s, help="seconds a session stays cached after its last use")
    parser.add_argument("--max-sessions", type=int, default=SessionConfig.max_sessions, help="sessions cached at once (LRU)")
    parser.add_argument("--session-host-memory", type=float, default=SessionConfig.host_memory_mib,
                        help="MiB of host memory for cached sessions (histories, drafter states); least recently used go first")


def engine_config_from_args(args: argparse.Namespace, drafter: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            args.model, args.device, args.dtype, args.max_model_len, args.trust_remote_code, args.num_threads,
            cache_dir=args.cache_dir, weights=args.weights, draft_model=args.draft_model,
            companion_model=args.companion_model,
        ),
        cache=CacheConfig(args.kv_cache_memory, args.block_size, args.attention_backend),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting,
            use_goodput_planner=not args.no_goodput_planner,
        ),
        spec=SpecConfig(
            drafter=drafter, copy_gamma=args.copy_gamma, copy_max_tokens=args.copy_max_tokens, ngram_k=args.ngram_k,
            ngram_w=args.ngram_w, pld_num_tokens=args.pld_num_tokens, pld_plus_ranking=args.pld_plus_ranking,
            pld_plus_max_tokens=args.pld_plus_max_tokens, pld_plus_layer=args.pld_plus_layer,
            pld_plus_num_heads=args.pld_plus_num_heads, num_draft_tokens=args.num_draft_tokens,
        ),
        sessions=SessionConfig(args.session_mode, args.session_ttl, args.max_sessions, args.session_host_memory),
    )


def add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API")
    add_engine_flags(serve)
    serve.add_argument("--drafter", choices=DRAFTER_NAMES, default="copyspec")
    serve.add_argument("--host", default=ServerConfig.host)
    serve.add_argument("--port", type=int, default=ServerConfig.port)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"require this bearer key on /v1 (default: ${API_KEY_ENV})")
    serve.add_argument("--engine-start-timeout", type=float, default=ServerConfig.engine_start_timeout_s,
                       help="seconds an engine may take to load before it counts as failed (raise it for large models)")
    serve.add_argument("--engine-max-restarts", type=int, default=ServerConfig.engine_max_restarts,
                       help="engine restarts allowed within --engine-restart-window; one more death and the server exits 1")
    serve.add_argument("--engine-restart-window", type=float, default=ServerConfig.engine_restart_window_s, help="seconds")
    serve.add_argument("--engine-stall-timeout", type=float, default=ServerConfig.engine_stall_timeout_s,
                       help="seconds an engine with requests in flight may send nothing before it is treated as dead")
    serve.add_argument("--drain-timeout", type=float, default=ServerConfig.drain_timeout_s,
                       help="SIGTERM: seconds requests in flight get to finish while new ones get 503")
    serve.add_argument("--max-choices", type=int, default=ServerConfig.max_choices, help="the largest n a request may ask for")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host, port=args.port, served_model_name=args.served_model_name, api_key=args.api_key or None,
        engine_start_timeout_s=args.engine_start_timeout, engine_max_restarts=args.engine_max_restarts,
        engine_restart_window_s=args.engine_restart_window, engine_stall_timeout_s=args.engine_stall_timeout,
        drain_timeout_s=args.drain_timeout, max_choices=args.max_choices,
    )


def serve(args: argparse.Namespace) -> None:
    """Serve until stopped; exit 1 when the engine cannot be kept running (server/supervision.py)."""
    from engine.model_source import resolve_model_source
    from server.app import build_app
    from server.drain import draining_server
    from server.engine_client import EngineClient
    from server.metrics import ServerMetrics
    from engine.tokenizer import load_tokenizer

    config = Config(engine=engine_config_from_args(args, args.drafter), server=server_config_from_args(args))
    model_name = config.server.served_model_name or resolve_model_source(config.engine.model.model).name
    engine = EngineClient(config.engine, config.server, ServerMetrics(model_name))
    app = build_app(config, engine, load_tokenizer(config.engine.model))
    server = draining_server(app, app.state.serving, config.server.host, config.server.port)
    engine.on_give_up = lambda: setattr(server, "should_exit", True)
    server.run()
    if engine.gave_up:
        raise SystemExit(1)
