"""PLD+ calibration, once per served model: which layer's hidden states and which attention heads rank copy sources.

The model answers a handful of prompts written for this (engine/calibration/prompts.py; none is from a benchmark set),
greedily. One plain forward over each prompt plus its answer gives every layer's hidden states and every head's
attention. Then, offline:
- heads (PLD+ §4.2.1): for each answer token that also occurs in the prompt, the source r* is its occurrence in the
  prompt with the longest suffix shared with the text so far; a head scores when its attention from the position that
  produced the token peaks, over all keys, at r* (our reading of the paper: argmax over all keys; heads ranked by hits
  over opportunities);
- every ranking is replayed where the answer's last token occurred before: the candidate it picks is scored by how
  many of the tokens after it the answer repeats (up to SCORE_TOKENS), as a draft would be accepted. The layer with the
  best mean for PLD+(h) is kept; for PLD+(a), the fewest heads (of HEAD_COUNTS) whose mean is within HEAD_TOLERANCE of
  the best count's, since every captured head is recomputed at every step. The better variant becomes the default.
The result is a small JSON file in the cache folder, named by the weights' fingerprint.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.artifacts import PldPlusCalibration, calibration_path, default_cache_dir, weights_fingerprint
from engine.calibration.answers import answers
from engine.calibration.options import CalibrationOptions
from engine.calibration.prompts import CALIBRATION_PROMPTS, chat_prompt_ids
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.tokenizer import load_tokenizer
from engine.wire import SamplingParams

logger = logging.getLogger("specserve.engine")

HEAD_COUNTS = (5, 10, 20, 50, 0)  # 0: every head
HEAD_TOLERANCE = 0.02  # a head set this close (relative) to the best one's score is preferred when smaller
SCORE_TOKENS = 10  # tokens after a candidate compared with the answer's (the paper tunes the layer with K = 10)


@dataclass
class Traced:
    """One prompt and its answer, with every hidden state and attention map of a plain forward over both."""

    token_ids: list[int]
    num_prompt: int
    hidden: list[torch.Tensor]  # per hidden-state index [positions, hidden], unit-normalised
    attention: torch.Tensor  # [layers, heads, positions, positions]


def trace(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> Traced:
    token_ids = prompt + answer
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the only implementation that returns attention maps
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([token_ids]), output_hidden_states=True, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    hidden = [torch.nn.functional.normalize(h[0].float(), dim=-1) for h in out.hidden_states]
    return Traced(token_ids, len(prompt), hidden, torch.stack([a[0] for a in out.attentions]).float())


def copy_points(traced: Traced) -> list[tuple[int, list[int]]]:
    """(t, candidates) for every answer position t whose token occurred before: the decisions PLD+ takes."""
    points = []
    tokens = traced.token_ids
    for t in range(traced.num_prompt, len(tokens) - 1):
        candidates = [j for j in range(1, t) if tokens[j] == tokens[t]]
        if candidates:
            points.append((t, candidates))
    return points


def accepted(tokens: list[int], j: int, t: int) -> int:
    """How many of the tokens after candidate j the text repeats after t (the proxy for an accepted draft)."""
    n = 0
    while n < SCORE_TOKENS and t + 1 + n < len(tokens) and tokens[j + 1 + n] == tokens[t + 1 + n]:
        n += 1
    return n


def head_hit_rates(traces: list[Traced]) -> torch.Tensor:
    """[layers, heads] fraction of copy opportunities where a head's attention peaked at the source (§4.2.1)."""
    layers, heads = traces[0].attention.shape[:2]
    hits, chances = torch.zeros(layers, heads), 0
    for traced in traces:
        tokens = traced.token_ids
        for t in range(traced.num_prompt, len(tokens)):
            sources = [r for r in range(traced.num_prompt) if tokens[r] == tokens[t]]
            if not sources:
                continue
            source = max(sources, key=lambda r: _shared_suffix(tokens, r, t))
            peaks = traced.attention[:, :, t - 1, :t].argmax(dim=-1)  # [layers, heads]
            hits += (peaks == source).float()
            chances += 1
    return hits / max(chances, 1)


def _shared_suffix(tokens: list[int], a: int, b: int) -> int:
    n = 0
    while a - 1 - n >= 0 and tokens[a - 1 - n] == tokens[b - 1 - n]:
        n += 1
    return n


def score(traces: list[Traced], choose) -> float:
    """Mean accepted-token proxy of CHOOSE(traced, t, candidates) -> j over every copy decision."""
    total, count = 0, 0
    for traced in traces:
        for t, candidates in copy_points(traced):
            total += accepted(traced.token_ids, choose(traced, t, candidates), t)
            count += 1
    return total / max(count, 1)


def by_hidden(layer: int):
    def choose(traced: Traced, t: int, candidates: list[int]) -> int:
        states = traced.hidden[layer]
        return candidates[int(torch.argmax(states[[j - 1 for j in candidates]] @ states[t - 1]))]
    return choose


def by_attention(heads: list[list[int]]):
    def choose(traced: Traced, t: int, candidates: list[int]) -> int:
        rows = torch.stack([traced.attention[layer, head, t - 1] for layer, head in heads])  # [heads, positions]
        return candidates[int(torch.argmax(rows.amax(dim=0)[candidates]))]
    return choose


def cheapest_head_count(head_scores: dict[int, float]) -> int:
    """The fewest heads (0 = all, the most) scoring within HEAD_TOLERANCE of the best head count."""
    best = max(head_scores.values())
    good = [count for count, s in head_scores.items() if s >= best * (1 - HEAD_TOLERANCE)]
    return min(good, key=lambda count: count or float("inf"))


def calibrate(traces: list[Traced]) -> PldPlusCalibration:
    num_states = len(traces[0].hidden)
    layer_scores = {layer: score(traces, by_hidden(layer)) for layer in range(1, num_states - 1)}
    best_layer = max(layer_scores, key=layer_scores.get)
    rates = head_hit_rates(traces)
    ranked = [
        [int(i // rates.shape[1]), int(i % rates.shape[1])] for i in torch.argsort(rates.flatten(), descending=True)
    ]
    head_scores = {count: score(traces, by_attention(ranked[:count] if count else ranked)) for count in HEAD_COUNTS}
    best_count = cheapest_head_count(head_scores)
    heads = ranked[:best_count] if best_count else ranked
    scores = {"first_match": score(traces, lambda traced, t, candidates: candidates[0]),
              "hidden": layer_scores[best_layer], "attention": head_scores[best_count],
              **{f"hidden_layer_{layer}": s for layer, s in layer_scores.items()},
              **{f"attention_heads_{count or 'all'}": s for count, s in head_scores.items()}}
    ranking = "attention" if scores["attention"] > scores["hidden"] else "hidden"
    logger.info("PLD+ calibration: hidden layer %d (%.3f), %d heads (%.3f), first match %.3f -> %s", best_layer,
                scores["hidden"], len(heads), scores["attention"], scores["first_match"], ranking)
    return PldPlusCalibration(ranking, best_layer, heads, scores, ranked)


def run_calibration(config, prompts: list[list[int]], max_tokens: int) -> tuple[PldPlusCalibration, Path]:
    """Answer PROMPTS greedily with the served model of CONFIG (an EngineConfig), calibrate, and save the result."""
    engine = Engine(replace(config, spec=replace(config.spec, drafter="none")))
    answered = answers(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(prompts))
    traces = []
    for i, (prompt, answer) in enumerate(zip(prompts, answered)):
        logger.info("PLD+ calibration: tracing prompt %d of %d", i + 1, len(prompts))
        traces.append(trace(engine.runner.model, prompt, answer))
    calibration = calibrate(traces)
    cache_dir = Path(config.model.cache_dir) if config.model.cache_dir else default_cache_dir()
    path = calibration_path(cache_dir, weights_fingerprint(engine.runner.model, engine.weights))
    calibration.save(path)
    return calibration, path


def calibrate_pld_plus(config: EngineConfig, options: CalibrationOptions) -> None:
    """Answer the calibration prompts (engine/calibration/prompts.py) and keep PLD+'s layer, heads and ranking."""
    prompts = chat_prompt_ids(load_tokenizer(config.model), CALIBRATION_PROMPTS)
    calibration, path = run_calibration(config, prompts, options.max_new_tokens)
    print(f"PLD+ calibration: {calibration.ranking} ranking, hidden layer {calibration.layer}, "
          f"{len(calibration.heads)} heads; scores {calibration.scores}\nsaved to {path}")
