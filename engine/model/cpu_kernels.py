"""specserve's own CPU kernels (engine/model/csrc): built once per host, loaded once per process.

- `torch.ops.specserve.w4a8_linear` (engine/model/w4a8.py): 4- or 8-bit weight blocks times activations rounded to
  8 bits, summed in integers (AVX512-VNNI).
- `torch.ops.specserve.row_attention` (engine/model/paged_attention.py): attention one query row at a time over the
  keys it may see (AVX-512F).

Compiled on first use with a C++ compiler and ninja (~1 min; `make setup` does it, the CPU image at build time)
into the user cache, keyed by the sources, the flags and torch's version. Each kernel is compiled for its
instruction set with target attributes, so the module loads on any x86-64 CPU; `has_vnni`/`has_avx512` say what
runs here. Where the build fails (no compiler) the engine runs torch's own kernels and says so in the log.
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
# -fopenmp: at::parallel_for is a header template that splits work over torch's OpenMP threads only when the
# extension is compiled with OpenMP; it then links the libgomp.so.1 that torch has already loaded (same soname)
CFLAGS = ("-O3", "-fopenmp")


@cache
def kernels():
    """The compiled extension, or None where this host cannot build it (the reason is logged)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch.utils.cpp_extension import load

    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # the venv's ninja
    digest = hashlib.sha256(torch.__version__.encode() + repr(CFLAGS).encode())
    for source in SOURCES:
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


def has_vnni() -> bool:
    """Whether w4a8_linear runs here."""
    module = kernels()
    return module is not None and module.has_vnni()


def has_avx512() -> bool:
    """Whether row_attention runs here."""
    module = kernels()
    return module is not None and module.has_avx512()
