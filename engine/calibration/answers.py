"""What every calibration tool does first: the served model answers prompts, and later forwards over prompt and
answer run outside the engine's paged pool."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from engine.engine import Engine
from engine.wire import EngineRequest, SamplingParams

WAVE = 128  # requests queued at once


def answers(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """ENGINE's answer to each of PROMPTS under its PARAMS, served together WAVE at a time (the engine's queue is
    bounded)."""
    tokens: dict[str, list[int]] = {f"calibrate-{i}": [] for i in range(len(prompts))}
    for start in range(0, len(prompts), WAVE):
        for i in range(start, min(start + WAVE, len(prompts))):
            engine.add_request(EngineRequest(f"calibrate-{i}", prompts[i], params[i]))
        while engine.has_work:
            for output in engine.step().outputs:
                tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[f"calibrate-{i}"] for i in range(len(prompts))]


@contextmanager
def plain_attention(models: tuple[torch.nn.Module, ...]):
    """transformers' SDPA attention instead of the paged pool's, for MODELS (the target first: an early exit's
    layers are the target's and read its config)."""
    previous = [model.config._attn_implementation for model in models]
    for model in models:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        for model, implementation in zip(models, previous):
            model.set_attn_implementation(implementation)
