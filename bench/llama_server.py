"""llama.cpp's `llama-server` as a benchmark peer: built from source by `make peers`, run on the same GGUF file.

Two configurations: plain decoding, and its own draft-free speculation (`--spec-type ngram-map-k`, 10 drafted
tokens: the strongest of its n-gram modes on a small CPU). The conversation benchmarks send it the very token ids
specserve gets (`/completion` with a token-id prompt, greedy, `return_tokens`), so the prompts and the chat template
are the same by construction; the concurrency benchmark drives its OpenAI chat endpoint like every other server,
with the chat template the GGUF carries.
"""
from __future__ import annotations

import time
from pathlib import Path

import httpx

from bench.runners import Generation
from bench.server_process import RunningServer, free_port, start_process, stop_server

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PEERS_DIR = REPO / ".peers"
SPECULATION_FLAGS = ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-m", "10")
CONTEXT_PER_SLOT = 4096  # tokens of KV per parallel slot: MT-Redundant turn 2 plus its answer fits
NAMES = {False: "llama-server", True: "llama-server-spec"}  # the runner / row names of the two configurations


def llama_server_binary(peers_dir: Path = DEFAULT_PEERS_DIR) -> Path:
    binary = peers_dir / "llama-server"
    if not binary.is_file():
        raise SystemExit(
            f"no llama-server in {peers_dir}: build it first with `make peers` (about 10 minutes, offline)"
        )
    return binary


def llama_commit(peers_dir: Path = DEFAULT_PEERS_DIR) -> str:
    path = peers_dir / "llama-server.commit"
    return path.read_text().strip() if path.is_file() else "unknown"


def llama_server_command(
    binary: Path, gguf_path: str, port: int, parallel: int, speculative: bool, threads: int
) -> list[str]:
    """Greedy-ready llama-server on loopback: PARALLEL slots of CONTEXT_PER_SLOT tokens, THREADS CPU threads, no GPU."""
    command = [str(binary), "--model", gguf_path, "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(parallel), "--ctx-size", str(CONTEXT_PER_SLOT * parallel),
               "--threads", str(threads), "--threads-batch", str(threads), "--n-gpu-layers", "0", "--jinja"]
    return command + list(SPECULATION_FLAGS if speculative else ())


class LlamaServerRunner:
    """Single-stream greedy generation through a running llama-server, from token ids to token ids."""

    is_peer_server = True

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.client = httpx.Client(timeout=httpx.Timeout(3600.0))

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        body = {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": 0.0, "return_tokens": True,
                "cache_prompt": True, "stream": False}
        start = time.perf_counter()
        response = self.client.post(self.server.base_url + "/completion", json=body)
        seconds = time.perf_counter() - start
        response.raise_for_status()
        reply = response.json()
        generation = Generation(list(reply.get("tokens") or []), seconds, num_forwards=0)
        generation.text = reply.get("content", "")
        draft = reply.get("timings", {})
        generation.drafted_tokens = int(draft.get("draft_n") or 0)
        generation.accepted_tokens = int(draft.get("draft_n_accepted") or 0)
        return generation

    def close(self) -> None:
        self.client.close()
        stop_server(self.server)


def start_llama_server(gguf_path: str, speculative: bool, log_dir: Path, parallel: int = 1, threads: int = 2,
                       peers_dir: Path = DEFAULT_PEERS_DIR) -> RunningServer:
    port = free_port()
    command = llama_server_command(llama_server_binary(peers_dir), gguf_path, port, parallel, speculative, threads)
    return start_process(command, port, log_dir)
