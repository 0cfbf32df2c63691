"""SPECTRA-retrieval's corpus (`specserve calibrate corpus`): text that exists offline and is in no benchmark set,
filtered by the served model's perplexity as the paper filters UltraChat and TheStack (Appendix B: the lowest-
perplexity samples, for an index that is small and whose guesses the model accepts).

Sources:
- answers: the served model's own greedy answers to the prompts written for calibration
  (engine/calibration/prompts.py), each scored given its prompt;
- code: the Python source of standard-library modules shipped with the interpreter (code, docstrings and comments),
  cut into samples of SAMPLE_TOKENS tokens.
Each sample's perplexity is exp of its tokens' mean negative log-likelihood under the served model. The lowest
`--corpus-keep` fraction of each source is kept (the threshold), lowest first, then as many of those as fit
`--corpus-mib` of index (drafters/retrieval.py's bytes per token).

The same forwards give the target's most likely next token after every token of every sample, and its probability:
with those of its answers sampled at T = 1 to `--corpus-sampled-prompts` training prompts (engine/training/prompts.py;
text whose every context the model might meet in sampled serving, where its greedy answers cover only their own
path), they make the table of the model's own confident next tokens (drafters/model_ngrams.py), within
`--model-ngrams-mib`. The sampled answers feed the table only: the retrieval index keeps the text the model finds
likeliest. The result is a JSON file in the model cache folder named by the weights' fingerprint
(engine/artifacts.py), which `--drafter spectra` loads at start-up.
"""
from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from drafters.model_ngrams import ModelNgrams
from drafters.retrieval import BYTES_PER_TOKEN
from engine.artifacts import CORPUS_RECIPE, SpectraCorpus, corpus_path, weights_fingerprint
from engine.calibration.answers import answers, plain_attention
from engine.calibration.options import CalibrationOptions
from engine.calibration.prompts import CALIBRATION_PROMPTS, CHAT_PROMPTS, CORPUS_PROMPTS, chat_prompt_ids
from engine.config import EngineConfig
from engine.drafter_context import model_cache_dir
from engine.engine import Engine
from engine.model.tokenizer import load_tokenizer
from engine.training.prompts import training_prompts
from engine.wire import SamplingParams

logger = logging.getLogger("specserve.engine")

SAMPLE_TOKENS = 256
SAMPLED_PROMPTS_SEED = 7  # training_prompts' seed for the sampled answers
STDLIB_MODULES = ("argparse", "calendar", "collections", "configparser", "csv", "dataclasses", "difflib",
                  "fractions", "functools", "heapq", "json", "logging", "pathlib", "shlex", "statistics", "string",
                  "textwrap", "urllib.parse")


@dataclass
class Sample:
    source: str  # "answers", "code" or "sampled"
    context: list[int]  # what the sample is scored after (an answer's prompt; nothing for code)
    token_ids: list[int]
    perplexity: float = math.inf
    predicted: list[int] = field(default_factory=list)  # the target's most likely token after each of token_ids
    confidence: list[float] = field(default_factory=list)  # its probability there


def score(model: torch.nn.Module, sample: Sample) -> None:
    """SAMPLE's perplexity under MODEL: exp of the mean negative log-likelihood of its tokens after its context (the
    first token unscored when the context is empty); and the model's prediction after each of its tokens."""
    ids = sample.context + sample.token_ids
    with torch.inference_mode():
        log_probs = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    nll = -log_probs[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    sample.perplexity = float(torch.exp(nll[max(len(sample.context) - 1, 0):].mean()))
    best = log_probs[len(sample.context):].max(-1)
    sample.predicted = best.indices.tolist()
    sample.confidence = best.values.exp().tolist()


def select(samples: list[Sample], keep: float, max_bytes: int) -> tuple[list[Sample], float]:
    """The lowest-perplexity KEEP fraction of each source, lowest first across sources, as many as fit MAX_BYTES of
    index; and the highest perplexity kept."""
    kept: list[Sample] = []
    for source in sorted({s.source for s in samples}):
        ranked = sorted((s for s in samples if s.source == source), key=lambda s: s.perplexity)
        kept += ranked[:max(1, round(keep * len(ranked)))]
    kept.sort(key=lambda s: s.perplexity)
    chosen, used = [], 0
    for sample in kept:
        if used + BYTES_PER_TOKEN * len(sample.token_ids) <= max_bytes:
            chosen.append(sample)
            used += BYTES_PER_TOKEN * len(sample.token_ids)
    return chosen, max((s.perplexity for s in chosen), default=0.0)


def answer_samples(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[Sample]:
    answered = answers(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(prompts))
    return [Sample("answers", prompt, answer) for prompt, answer in zip(prompts, answered) if len(answer) > 1]


def code_samples(tokenizer) -> list[Sample]:
    samples = []
    for module in STDLIB_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        ids = tokenizer(Path(spec.origin).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        samples += [Sample("code", [], ids[start:start + SAMPLE_TOKENS])
                    for start in range(0, len(ids) - SAMPLE_TOKENS // 2, SAMPLE_TOKENS)]
    return samples


def sampled_samples(engine: Engine, tokenizer, count: int, max_tokens: int) -> list[Sample]:
    """ENGINE's answers at T = 1 (each seeded) to COUNT training prompts."""
    prompts = chat_prompt_ids(tokenizer, tuple(training_prompts(count, seed=SAMPLED_PROMPTS_SEED)))
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i) for i in range(len(prompts))]
    return [Sample("sampled", prompt, answer) for prompt, answer in zip(prompts, answers(engine, prompts, params))
            if len(answer) > 1]


def corpus_samples(engine: Engine, tokenizer, max_new_tokens: int) -> list[Sample]:
    """Every sample of the retrieval index's sources, unscored: ENGINE's answers to the calibration prompts, then the
    code."""
    prompts = chat_prompt_ids(tokenizer, CALIBRATION_PROMPTS + CHAT_PROMPTS + CORPUS_PROMPTS)
    return answer_samples(engine, prompts, max_new_tokens) + code_samples(tokenizer)


def build_corpus(config: EngineConfig, options: CalibrationOptions) -> None:
    """Answer the calibration prompts, cut the standard library's source into samples, score every sample's perplexity
    under the served model, keep the lowest and save them for SPECTRA-retrieval."""
    tokenizer = load_tokenizer(config.model)
    engine = Engine(replace(config, spec=replace(config.spec, drafter="none")))
    samples = corpus_samples(engine, tokenizer, options.max_new_tokens)
    sampled = sampled_samples(engine, tokenizer, options.corpus_sampled_prompts, options.max_new_tokens)
    model = engine.runner.model
    with plain_attention((model,)):
        for i, sample in enumerate(samples + sampled):
            if i % 50 == 0:
                logger.info("corpus: scoring sample %d of %d", i + 1, len(samples) + len(sampled))
            score(model, sample)
    chosen, cutoff = select(samples, options.corpus_keep, options.corpus_mib * 2**20)
    sources = {source: sum(s.source == source for s in chosen) for source in ("answers", "code")}
    table = ModelNgrams.from_predictions(((s.token_ids, s.predicted, s.confidence) for s in samples + sampled),
                                         max_bytes=options.model_ngrams_mib * 2**20)
    corpus = SpectraCorpus([s.token_ids for s in chosen], cutoff, sources, options.command, table.to_json(),
                           CORPUS_RECIPE)
    path = corpus_path(model_cache_dir(config.model), weights_fingerprint(model, engine.weights))
    corpus.save(path)
    print(f"SPECTRA corpus: {len(chosen)} of {len(samples)} samples ({sources}), "
          f"{sum(len(s.token_ids) for s in chosen)} tokens, perplexity at most {cutoff:.2f}; model n-grams: "
          f"{len(table.entries)} entries from {sum(len(s.token_ids) for s in samples + sampled)} tokens "
          f"({len(sampled)} sampled answers)\nsaved to {path}")
