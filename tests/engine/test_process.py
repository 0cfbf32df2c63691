"""The engine process's loop leaves when its server is gone, even while a send waits for it."""
import time

import pytest

from engine.config import EngineConfig
from engine.process import EngineLoop
from engine.wire import EngineOutputs, StepStats


def test_a_send_to_a_server_that_is_gone_ends_the_engine(tmp_path):
    """No server ever bound the output address, as when it was killed: the sends queue up to ZeroMQ's high-water
    mark (1,000 messages), then a send waits, notices the engine's parent is not the one it started with, and exits
    instead of waiting for ever."""
    loop = EngineLoop(EngineConfig(), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    loop.parent_pid = -1  # the parent it started with is gone
    start = time.monotonic()
    with pytest.raises(SystemExit):
        for _ in range(5000):
            loop.send(EngineOutputs(outputs=[], stats=StepStats()))
    assert time.monotonic() - start < 10
    loop.context.destroy(linger=0)


def test_a_send_waits_while_the_server_exists(tmp_path):
    import zmq

    loop = EngineLoop(EngineConfig(), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    server = loop.context.socket(zmq.PULL)
    server.bind(f"ipc://{tmp_path}/out")
    loop.send(EngineOutputs(outputs=[], stats=StepStats()))
    assert server.poll(5000) and server.recv()
    loop.context.destroy(linger=0)
