"""The soak's memory measure: pages of the KV pool that a load writes are left out of the resident memory it checks."""
from __future__ import annotations

import os

import torch

from bench.soak import POOL_MAPPING_BYTES, resident_mib
from engine.model.paged_attention import _zeros

TOUCHED_MIB = 128


def test_writing_kv_pool_pages_leaves_the_measured_resident_memory_alone():
    pool = _zeros((POOL_MAPPING_BYTES + 2**20,), torch.uint8, torch.device("cpu"))
    before = resident_mib(os.getpid())
    pool[: TOUCHED_MIB * 2**20].fill_(1)  # the OS backs these pages now
    after = resident_mib(os.getpid())
    assert abs(after - before) < TOUCHED_MIB / 8, (before, after)
