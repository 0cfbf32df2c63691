"""Drive an Engine in-process to completion."""
from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.wire import EngineRequest, RequestOutput, SamplingParams, StepStats


def run_to_completion(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams], step_stats: list[StepStats] | None = None
) -> dict[str, RequestOutput]:
    """Submit all prompts at once; returns per request id the concatenated outputs (logprobs, prompt logprobs) and the
    final stats.

    step_stats, if given, receives every step's statistics.
    """
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        assert engine.add_request(EngineRequest(f"req-{i}", prompt, p)) is None
    tokens: dict[str, list[int]] = {f"req-{i}": [] for i in range(len(prompts))}
    logprobs: dict[str, list] = {f"req-{i}": [] for i in range(len(prompts))}
    prompt_logprobs: dict[str, list] = {}
    finals: dict[str, RequestOutput] = {}
    while engine.has_work:
        step = engine.step()
        if step_stats is not None:
            step_stats.append(step.stats)
        for output in step.outputs:
            tokens[output.request_id] += output.new_token_ids
            logprobs[output.request_id] += output.logprobs or []
            if output.prompt_logprobs is not None:
                assert output.request_id not in prompt_logprobs, "prompt log-probabilities are sent once"
                prompt_logprobs[output.request_id] = output.prompt_logprobs
            if output.finish_reason:
                finals[output.request_id] = output
    for request_id, output in finals.items():
        output.new_token_ids = tokens[request_id]
        output.logprobs = logprobs[request_id] if output.logprobs is not None else None
        output.prompt_logprobs = prompt_logprobs.get(request_id)
    return finals


def gguf_param() -> "pytest.param":
    """The gguf weight mode as a test parameter, skipped (with the reason) where its kernels cannot run."""
    from engine.model.block_linear import available

    return pytest.param("gguf", marks=pytest.mark.skipif(
        not available(), reason="--weights gguf needs AVX2 or AVX512-VNNI and a C++ compiler for its kernels"))
