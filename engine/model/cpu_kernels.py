"""specserve's own CPU kernels (engine/model/csrc): built once per host, loaded once per process.

- `torch.ops.specserve.block_linear` (engine/model/block_linear.py): GGUF-style weight blocks times activations
  rounded to 8 bits, summed in integers (AMX, AVX512-VNNI or AVX2, chosen at run time, the same bits on each).
- `torch.ops.specserve.row_attention` (engine/model/paged_attention.py): attention one query row at a time over the
  keys it may see (AVX-512F or AVX2 with FMA, the same bits on each).
- `torch.ops.specserve.rms_norm`, `add_rms_norm`, `gated_activation`, `rope_write`, `span_attention`
  (engine/model/csrc/fused_ops.cpp, engine/model/decoder.py): a decoder layer's small operators fused, one call where
  torch takes several (AVX-512F, AVX2 or baseline x86-64, the same bits on each; span_attention calls row_attention).

Compiled on first use with a C++ compiler and ninja (~1 min; `make setup` does it, the CPU image at build time)
into the user cache, keyed by the sources, their folder, the flags and torch's version (two checkouts each keep
their own build: ninja rebuilds a shared one whenever the sources' paths change). Each kernel is compiled for its
instruction set with target attributes, so the module loads on any x86-64 CPU; `cpu_isa`/`row_attention_available`
say what runs here. SPECSERVE_CPU_ISA caps them: `avx512vnni` leaves block_linear's AMX variant unused, `avx2` only
the AVX2 variants (to run them on an AVX-512 machine), `none` none of the kernels. Where the build fails (no
compiler) the engine runs torch's own kernels and says so in the log.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger("specserve.engine")
SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # included by the sources: part of the cache key
# -fopenmp: at::parallel_for is a header template that splits work over torch's OpenMP threads only when the
# extension is compiled with OpenMP; it then links the libgomp.so.1 that torch has already loaded (same soname)
# -ffp-contract=off: no fused multiply-adds unless a kernel asks for them, so block_linear's float32 steps round as
# written (a reference reproduces them bit for bit, and its AVX2 and AVX512 variants agree)
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
ISAS = ("amx", "avx512vnni", "avx2")  # block_linear's variants, best first (AMX: AVX512-VNNI with AMX-INT8 tiles)


@cache
def kernels():
    """The compiled extension, or None where this host cannot build it (the reason is logged)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch.utils.cpp_extension import load

    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # the venv's ninja
    digest = hashlib.sha256(torch.__version__.encode() + repr(CFLAGS).encode() + str(SOURCES[0].parent).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    build_dir = cache_root / "specserve" / "kernels" / digest.hexdigest()[:12]
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.info("compiling specserve's CPU kernels into %s (once, about a minute)", build_dir)
    try:
        return load(name="specserve_kernels", sources=[str(s) for s in SOURCES], build_directory=str(build_dir),
                    extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # no compiler, no ninja, or a failed build: torch's own kernels still serve
        logger.warning("specserve's CPU kernels could not be built here (%s); serving with torch's own", error)
        return None


def isa_cap() -> str | None:
    """The best instruction set SPECSERVE_CPU_ISA allows: None (no cap), "avx512vnni", "avx2", or "none" (no
    kernels)."""
    cap = os.environ.get("SPECSERVE_CPU_ISA", "").strip().lower()
    if cap in ("", "auto", "amx"):
        return None
    if cap == "avx512":
        return "avx512vnni"
    if cap not in ISAS + ("none",):
        raise ValueError(f"SPECSERVE_CPU_ISA must be amx, avx512vnni, avx2 or none, got {cap!r}")
    return cap


def isa_supported(isa: str) -> bool:
    """Whether this CPU and the built module run block_linear's ISA variant, whatever the cap."""
    module = kernels()
    if module is None:
        return False
    return {"amx": module.has_amx, "avx512vnni": module.has_vnni, "avx2": module.has_avx2}[isa]()


def cpu_isa() -> str | None:
    """The variant of block_linear to run here: the best this CPU has within the cap ("amx", "avx512vnni", "avx2"),
    or None."""
    cap = isa_cap()
    if cap == "none":
        return None
    allowed = ISAS[ISAS.index(cap):] if cap else ISAS
    return next((isa for isa in allowed if isa_supported(isa)), None)


def row_attention_available() -> bool:
    """Whether row_attention runs here: its AVX-512F variant, or its AVX2 one (with FMA, or under an AVX2 cap)."""
    module = kernels()
    return module is not None and isa_cap() != "none" and module.row_attention_isa() != "none"


def fused_ops_available() -> bool:
    """Whether the lean decoder's fused operators (engine/model/csrc/fused_ops.cpp) run here: wherever the module
    builds, but not under SPECSERVE_CPU_ISA=none."""
    return kernels() is not None and isa_cap() != "none"
