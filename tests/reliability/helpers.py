"""What the reliability tests share: a long streaming request, probe reads that tolerate a closed port, polling."""
from __future__ import annotations

import time

import httpx

MODEL = "SmolLM2-135M-Instruct"
LONG_STREAM = {
    "model": MODEL, "stream": True, "max_tokens": 3000, "temperature": 0.8, "seed": 1, "ignore_eos": True,
    "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse keeper."}],
}
SHORT = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Say hello."}]}


def status(base_url: str, path: str) -> int | None:
    try:
        return httpx.get(base_url + path, timeout=2).status_code
    except httpx.TransportError:
        return None


def wait_for(predicate, deadline_s: float, interval_s: float = 0.1) -> bool:
    """Whether PREDICATE() came true within DEADLINE_S seconds."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)  # polling interval, bounded by the deadline
    return False


def pid_alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def stream_until_it_ends(response: httpx.Response, after_first_lines, *, lines_first: int = 3) -> tuple[str, float]:
    """Read LINES_FIRST lines, call AFTER_FIRST_LINES(), then read to the end: (the rest, seconds it took to end)."""
    lines = response.iter_lines()
    for _ in range(lines_first):
        next(lines)
    after_first_lines()
    start = time.monotonic()
    rest = "\n".join(lines)
    return rest, time.monotonic() - start
