"""The restart budget: back-off doubling per restart in the window, a bound per window, and death causes."""
import signal

from server.supervision import MAX_DELAY_S, RestartBudget, death_cause, exit_reason


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_restarts_back_off_and_stop_at_the_bound_within_the_window():
    clock = Clock()
    budget = RestartBudget(max_restarts=3, window_s=100, clock=clock)
    assert [budget.next_delay() for _ in range(3)] == [1.0, 2.0, 4.0]
    assert budget.next_delay() is None  # a fourth death within the window: give up
    clock.now = 101  # the first three left the window
    assert budget.next_delay() == 1.0


def test_the_back_off_is_capped():
    budget = RestartBudget(max_restarts=20, window_s=1e9, clock=Clock())
    assert max(budget.next_delay() for _ in range(20)) == MAX_DELAY_S


def test_no_restart_allowed_gives_up_at_the_first_death():
    assert RestartBudget(max_restarts=0, window_s=10, clock=Clock()).next_delay() is None


def test_death_reasons_name_their_cause():
    assert exit_reason(-signal.SIGKILL) == "signal: the engine process was killed by SIGKILL"
    assert exit_reason(1) == "exit: the engine process exited with code 1"
    assert death_cause(exit_reason(-signal.SIGKILL)) == "signal"
    assert death_cause(exit_reason(3)) == "exit"
    assert death_cause("wedged: no output for 130 s with 2 requests in flight") == "wedged"
    assert death_cause("error: RuntimeError: CUDA error") == "error"
