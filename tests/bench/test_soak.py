"""The soak's memory measure: pages of the KV pool that a load writes are left out of the resident memory it checks."""
from __future__ import annotations

import os

import psutil
import torch

from bench.soak import POOL_MAPPING_BYTES, _kv_pool_resident_bytes, resident_mib
from engine.model.paged_attention import _zeros

TOUCHED_MIB = 128


def test_writing_kv_pool_pages_leaves_the_measured_resident_memory_alone():
    """The pool's pages are recognised as the pool's as they are written, and none of them counts as the process's
    own. The rest of the process may shrink meanwhile (the host reclaims cold pages: 233 MiB once, mid-test), so
    only growth counts against it."""
    pool = _zeros((POOL_MAPPING_BYTES + 2**20,), torch.uint8, torch.device("cpu"))
    process = psutil.Process(os.getpid())
    before, pool_before = resident_mib(os.getpid()), _kv_pool_resident_bytes(process)
    pool[: TOUCHED_MIB * 2**20].fill_(1)  # the OS backs these pages now
    after, pool_after = resident_mib(os.getpid()), _kv_pool_resident_bytes(process)
    assert (pool_after - pool_before) / 2**20 >= 0.9 * TOUCHED_MIB, (pool_before, pool_after)
    assert after - before < TOUCHED_MIB / 8, (before, after)
