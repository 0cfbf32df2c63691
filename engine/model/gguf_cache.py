"""A GGUF model dequantized once into a plain transformers checkpoint under the user cache.

transformers parses and dequantizes a GGUF file on every `from_pretrained(gguf_file=...)`, which is slow even for a
small model and its tokenizer. The dequantized float32 weights, config, generation config, tokenizer and chat template
are written once to `$XDG_CACHE_HOME/specserve/dequantized/<gguf stem>/` (default `~/.cache/specserve`) and loaded
from there, which is lossless: the same float32 tensors, cast to the requested dtype the same way. A stamp of the
GGUF's path, size, mtime and the transformers version rebuilds it when either changes.

One process builds at a time (a lock on the cache folder); it writes to a hidden partial folder and renames it into
place, so a reader never sees a half-written checkpoint.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from engine.model.model_source import ModelSource

logger = logging.getLogger("specserve.engine")

STAMP_FILE = "specserve-source.json"
CACHE_FORMAT = 1  # bump when save_dequantized writes something different


def default_cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specserve" / "dequantized"


def loadable_source(source: ModelSource) -> ModelSource:
    """What `from_pretrained` should load for SOURCE: a GGUF's cached checkpoint (built on first use), else SOURCE.

    The served name stays SOURCE's. Where the cache cannot be written, the GGUF itself, with a warning.
    """
    if source.gguf_file is None:
        return source
    try:
        directory = dequantized_dir(source)
    except OSError as error:
        logger.warning("cannot cache %s dequantized (%s); loading the GGUF file directly", source.gguf_file, error)
        return source
    return ModelSource(name=source.name, path=str(directory))


def dequantized_dir(source: ModelSource, cache_root: Path | None = None) -> Path:
    """CACHE_ROOT/<gguf stem>, holding SOURCE's GGUF as a current transformers checkpoint; builds it if needed."""
    gguf = Path(source.path) / source.gguf_file
    stamp = _stamp(gguf)
    target = (cache_root or default_cache_root()) / gguf.stem
    if _is_current(target, stamp):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        if not _is_current(target, stamp):  # another process may have built it while this one waited
            _build(source, target, stamp)
    return target


def save_dequantized(source: ModelSource, directory: Path) -> None:
    """Model (float32), generation config, tokenizer and chat template of a GGUF file as a transformers checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=torch.float32, **_dense_gguf_kwargs()
    )
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    if getattr(model, "hf_quantizer", None) is not None and any(p.dtype != torch.float32 for p in model.parameters()):
        raise RuntimeError(f"{source.gguf_file} loaded with packed GGUF weights; cannot write a dequantized copy")
    # The weights are plain float32 tensors already; only the GGUF quantizer marks the model unsaveable.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]  # GGUF configs leave it empty; transformers serve needs it
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)  # writes the chat template too


def _dense_gguf_kwargs() -> dict:
    """Unpack every GGUF weight: with the `kernels` package installed, transformers would otherwise keep them packed."""
    try:
        from transformers import GgufConfig
    except ImportError:  # a transformers without packed GGUF loading always unpacks
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _stamp(gguf: Path) -> dict:
    import transformers

    stat = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "transformers": transformers.__version__, "format": CACHE_FORMAT}


def _is_current(target: Path, stamp: dict) -> bool:
    try:
        return json.loads((target / STAMP_FILE).read_text()) == stamp
    except (OSError, ValueError):
        return False


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """An exclusive lock on the cache root folder itself, so no lock file is left beside the checkpoints."""
    root = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(root, fcntl.LOCK_EX)  # released when the descriptor closes
        yield
    finally:
        os.close(root)


def _build(source: ModelSource, target: Path, stamp: dict) -> None:
    """Under the build lock: write a partial folder, then swap it in for TARGET."""
    logger.warning("dequantizing %s into %s (once per GGUF file)", source.gguf_file, target)
    for leftover in target.parent.iterdir():  # partial or stale folders of killed builds
        if leftover.name.startswith((f".{target.name}.partial-", f".{target.name}.stale-")):
            shutil.rmtree(leftover, ignore_errors=True)
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        save_dequantized(source, partial)
        (partial / STAMP_FILE).write_text(json.dumps(stamp, indent=1))
        if target.exists():  # an out-of-date build: moved aside first, since rename cannot replace a folder
            stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
            target.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        partial.rename(target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
