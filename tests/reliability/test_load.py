"""A short load run against a real server (`make soak` is the long one, bench/soak.py): concurrent streaming
clients with random lengths and temperatures, some hanging up mid-stream. Every stream not hung up on ends with a
finish_reason and [DONE], nothing fails, the KV blocks in use return to zero and memory (apart from the KV pool's
pages, which stay resident once written) to near its baseline."""
from __future__ import annotations

import pytest

from bench.server_process import start_server, stop_server
from bench.soak import LoadConfig, resident_mib, run_load, settle

CLIENTS, SECONDS = 12, 10
MEMORY_GROWTH_BOUND = 0.10  # after the load, server + engine RSS within 10% of the baseline (the soak's bound)


@pytest.mark.slow
def test_streams_under_load_all_end_properly_and_resources_return(tmp_path):
    server = start_server(tmp_path, "--session-mode", "off", "--max-num-seqs", "8")
    try:
        # warm the allocator
        run_load(server.base_url, server.process.pid, LoadConfig(clients=2, duration_s=3, seed=99))
        settle(server.base_url)
        baseline = resident_mib(server.process.pid)
        report = run_load(
            server.base_url, server.process.pid, LoadConfig(clients=CLIENTS, duration_s=SECONDS, hang_up_share=0.25)
        )
        health = settle(server.base_url)
        after = resident_mib(server.process.pid)
    finally:
        stop_server(server)
    summary = report.summary()
    # every client sent requests, and both ends were exercised (how many complete in the time is the host's speed)
    assert report.requests >= CLIENTS and report.completed > 0 and report.hung_up > 0, summary
    assert report.truncated == 0 and not report.errors, summary
    assert (health["num_running"], health["num_waiting"], health["kv_cache_usage"]) == (0, 0, 0), health
    assert after <= baseline * (1 + MEMORY_GROWTH_BOUND), (baseline, after)
