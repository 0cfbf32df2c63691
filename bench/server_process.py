"""Start, wait for and stop a server process on loopback (specserve or a peer), for benchmarks and tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STARTUP_DEADLINE_S = 300.0


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str
    log_path: Path
    health_statuses: list[int] = field(default_factory=list)  # /health answers seen while starting

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def engine_pid(self) -> int:
        """specserve's engine is the server's child process."""
        engines = self.engine_pids()
        if not engines:
            raise RuntimeError(f"no engine child of server {self.process.pid}")
        return engines[0]

    def engine_pids(self) -> list[int]:
        """Every engine process the server has (one, unless an old one leaked)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return [pid for pid in map(int, children) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies, however that dies (a test run or
    benchmark killed outright leaves no server behind; the engine then sees its server gone and exits too)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def specserve_command(port: int, *extra_args: str) -> list[str]:
    return [sys.executable, "-m", "specserve", "serve", "--host", "127.0.0.1", "--port", str(port), *extra_args]


def start_process(
    command: list[str], port: int, log_dir: Path, deadline_s: float = STARTUP_DEADLINE_S,
    env: dict[str, str] | None = None,
) -> RunningServer:
    """Run `command` in its own process group, logging to LOG_DIR/server-PORT.log; `env` is added to this
    environment."""
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **env} if env else None, preexec_fn=die_with_parent,
        )
    server = RunningServer(process, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_until_healthy(server, deadline_s)
    except BaseException:
        stop_server(server)
        raise
    return server


def start_server(log_dir: Path, *extra_args: str) -> RunningServer:
    """A specserve started as `make serve` starts it, on a free loopback port."""
    port = free_port()
    return start_process(specserve_command(port, *extra_args), port, log_dir)


def wait_until_healthy(server: RunningServer, deadline_s: float = STARTUP_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            server.health_statuses.append(httpx.get(server.base_url + "/health", timeout=2).status_code)
            if server.health_statuses[-1] == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # poll interval while waiting for readiness, bounded by the deadline
    raise TimeoutError(f"server not healthy after {deadline_s} s:\n{server.log()}")


def stop_server(server: RunningServer) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers."""
    if server.process.poll() is None:
        os.killpg(server.process.pid, signal.SIGTERM)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
