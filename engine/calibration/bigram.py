"""The model bigram table (drafters/bigram.py), built ahead of serving instead of at first start."""
from __future__ import annotations

from pathlib import Path

from drafters.registry import model_bigram
from engine.calibration.options import CalibrationOptions
from engine.config import EngineConfig, ModelConfig
from engine.drafter_context import drafter_context
from engine.model.model_loader import load_model


def build_model_tables(config: ModelConfig) -> dict[str, Path]:
    """Load the model and build every table drafters derive from it (the model bigram), or find it cached."""
    loaded = load_model(config)
    table = model_bigram(drafter_context(loaded, config))
    if table.wait() is None:
        raise RuntimeError("building the model bigram table failed (see the log)")
    return {"bigram": table.path}


def build_bigram(config: EngineConfig, options: CalibrationOptions) -> None:
    """Build (or find) every model-derived table for the model CONFIG names, as `serve` would on first start."""
    for name, path in build_model_tables(config.model).items():
        print(f"{name}: {path}")
