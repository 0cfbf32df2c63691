"""The weights a CPU forward streams, moved into transparent huge pages.

A decode step reads every weight of the model once; in 4 KiB pages that is a TLB miss every 4 KiB (27,000 for the
default model's 108 MB), and on a virtual machine each miss walks two page tables. In 2 MiB pages the same weights
span about 50. Measured on a 2-core EPYC VM (THP in `madvise` mode, the common default), engines with and without in
one process taking turns: forwards of the default model 0-5 % faster (1 token 9.40 -> 9.03 ms, 2 tokens 10.8 -> 10.2
ms at best). Without it, the first of several engines in one process ran its forwards 1.5-2.5 % faster than the
later ones (where its weights happened to lie), a bias the benchmarks' ratios no longer carry.

torch allocates small tensors (a layer's weights are 0.1-1 MB each) where the OS will not give huge pages, so the
tensors are copied side by side into one anonymous mapping advised MADV_HUGEPAGE. The copy keeps every value, shape
and stride: outputs are the same bits. Where the OS has no transparent huge pages (or `never`), the mapping is plain
memory and nothing changes. The KV pool stays out of huge pages (engine/model/paged_attention.py says why).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections.abc import Iterable

import torch

ALIGNMENT = 64  # bytes each tensor starts on: a cache line, as torch aligns its own


def move_to_huge_pages(modules: Iterable[torch.nn.Module]) -> int:
    """Move the parameters and buffers of MODULES (and their submodules) that live on the CPU into one mapping in
    huge pages, each tensor shared by several modules moved once -> the bytes moved (0 where the OS cannot advise
    huge pages)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    slots = list(_tensor_slots(modules))
    unique = list({id(tensor): tensor for _, _, _, tensor in slots}.values())
    if not unique:
        return 0
    offsets, total = _offsets(unique)
    memory = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared memory has no THP
    memory.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, so the copies fault in huge pages
    flat = torch.frombuffer(memory, dtype=torch.uint8, count=total)
    moved = {id(tensor): _copy_into(flat, offset, tensor) for tensor, offset in zip(unique, offsets)}
    for module, kind, name, tensor in slots:
        getattr(module, kind)[name] = moved[id(tensor)]
    del slots, unique
    _return_freed_memory()
    return total


def _return_freed_memory() -> None:
    """Hand the originals' memory back to the OS: glibc keeps freed blocks below its mmap threshold in its heap (for
    the default model, 200 MB of resident memory that loading freed), where malloc_trim returns them."""
    library = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(library), "malloc_trim", None) if library else None
    if trim is not None:
        trim(0)


def _tensor_slots(modules: Iterable[torch.nn.Module]):
    """(module, "_parameters" or "_buffers", name, tensor) for each dense CPU tensor of MODULES, each module once."""
    seen = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for kind in ("_parameters", "_buffers"):
                for name, tensor in getattr(module, kind).items():
                    if tensor is not None and tensor.device.type == "cpu" and _dense(tensor):
                        yield module, kind, name, tensor  # the object itself: a tied weight is one, in two modules


def _dense(tensor: torch.Tensor) -> bool:
    """Whether TENSOR's elements fill its storage exactly from its start, in whatever order its strides give (a
    transposed contiguous weight is dense): then a copy with the same strides fits in as many bytes."""
    size = tensor.numel() * tensor.element_size()
    return size > 0 and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == size


def _offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    return offsets, total


def _copy_into(flat: torch.Tensor, offset: int, tensor: torch.Tensor) -> torch.Tensor:
    """TENSOR's values at OFFSET bytes into FLAT, with TENSOR's dtype, shape and strides (a frozen Parameter where
    TENSOR is a Parameter)."""
    size = tensor.numel() * tensor.element_size()
    copy = flat[offset:offset + size].view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
    copy.copy_(tensor.detach())
    return torch.nn.Parameter(copy, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else copy
