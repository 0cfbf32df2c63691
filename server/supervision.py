"""How the server looks after its engine process: when to start it again, and when to give up.

- A dead engine is started again after a back-off: 1 s, then twice as long per restart
  already made within the window, at most MAX_DELAY_S.
- At most `max_restarts` restarts within any `window_s` seconds; one more death and the
  server gives up and exits non-zero, so that an orchestrator (Kubernetes, systemd,
  Docker's restart policy) sees a failing process rather than a server that restarts
  an engine which can never run.
- An engine that never became ready at start-up is not restarted: that is a
  configuration the same engine would fail again on (missing weights, too little memory).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self._restarts: deque[float] = deque()  # times of the restarts within the window

    def next_delay(self) -> float | None:
        """Seconds to wait before the next restart (and count it), or None when the budget is spent."""
        now = self.clock()
        while self._restarts and now - self._restarts[0] > self.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.max_restarts:
            return None
        delay = min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** len(self._restarts))
        self._restarts.append(now)
        return delay


def death_cause(reason: str) -> str:
    """The metric label of a death reason (engine_client.py writes the reasons)."""
    for cause in ("wedged", "start_timeout", "signal", "error"):
        if reason.startswith(cause):
            return cause
    return "exit"


def exit_reason(exitcode: int | None) -> str:
    """A dead process's exit code in words: a negative code is the signal that killed it."""
    if exitcode is not None and exitcode < 0:
        import signal

        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"signal: the engine process was killed by {name}"
    return f"exit: the engine process exited with code {exitcode}"
