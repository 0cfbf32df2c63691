"""Generators the benchmark compares: our engine per drafter, and transformers' own `generate`."""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from engine.engine import Engine
from engine.model.model_loader import LoadedModel
from engine.wire import EngineRequest, SamplingParams

HF_PLD_NUM_TOKENS = 10  # prompt_lookup_num_tokens of the hf-pld peer
Key = TypeVar("Key")


@dataclass
class Generation:
    token_ids: list[int]
    seconds: float  # from submission to the last token, prefill included (an engine's own steps only)
    num_forwards: int = 0  # target forward calls that carried the request (prefill included)
    num_drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    lookahead_rows: int = 0  # look-ahead rows its forwards carried (drafters/spectra.py's candidate pool)
    # [depth - 1] drafted tokens accepted at each depth (an engine's step stats, summed: `acceptance_by_depth`)
    accepted_per_position: list[int] = field(default_factory=list)
    text: str | None = None  # the server's own text, for peers compared by text (bench/llama_server.py)


class EngineRunner:
    """Generation through a specserve Engine, in this process: greedy, or sampled at TEMPERATURE with each request
    seeded by its prompt (so every runner draws the same seed for the same question). It waits
    for the drafter's model bigram table if one is being built in the background (the first use of ngram on a
    machine): a build beside the measurements would slow every runner of the run while it lasts."""

    def __init__(self, engine: Engine, temperature: float = 0.0) -> None:
        self.engine = engine
        self.temperature = temperature
        self._count = 0
        bigram = getattr(engine.speculation.drafter, "bigram", None)
        if bigram is not None and bigram.wait() is None:
            raise RuntimeError("the model bigram table could not be built")

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        return self.start(prompt_ids, max_new_tokens).finish()

    def start(self, prompt_ids: list[int], max_new_tokens: int) -> InFlight:
        """Submit one request, to be run a step at a time (the engine serves nothing else meanwhile)."""
        self._count += 1
        params = SamplingParams(temperature=self.temperature, max_tokens=max_new_tokens,
                                seed=hash(tuple(prompt_ids)) % 2**31 if self.temperature else None)
        return InFlight(self.engine, EngineRequest(f"bench-{self._count}", prompt_ids, params))

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy answers to all prompts, served together by the continuous-batching engine (untimed)."""
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        ids = []
        for prompt_ids in prompts:
            self._count += 1
            ids.append(f"bench-{self._count}")
            self.engine.add_request(EngineRequest(ids[-1], prompt_ids, params))
        token_ids: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while self.engine.has_work:
            for output in self.engine.step().outputs:
                token_ids[output.request_id] += output.new_token_ids
        return [token_ids[request_id] for request_id in ids]


class InFlight:
    """One request on an engine, run a step at a time; `seconds` counts its submission and its own steps only, so
    requests on several engines can take turns (`generate_together`)."""

    def __init__(self, engine: Engine, request: EngineRequest) -> None:
        self.engine = engine
        self.token_ids: list[int] = []
        self.num_forwards = 0
        self.lookahead_rows = 0
        self.accepted_per_position: list[int] = []
        self.spec = None
        start = time.perf_counter()
        engine.add_request(request)
        self.seconds = time.perf_counter() - start

    @property
    def done(self) -> bool:
        return not self.engine.has_work

    def step(self) -> None:
        start = time.perf_counter()
        step = self.engine.step()
        self.seconds += time.perf_counter() - start
        self.num_forwards += 1
        self.lookahead_rows += step.stats.num_lookahead_rows
        for spec in step.stats.spec_by_drafter.values():
            self.accepted_per_position = summed([self.accepted_per_position, spec.num_accepted_per_position])
        for output in step.outputs:
            self.token_ids += output.new_token_ids
            self.spec = output.spec or self.spec

    def finish(self) -> Generation:
        while not self.done:
            self.step()
        return Generation(self.token_ids, self.seconds, self.num_forwards, self.spec.num_drafts,
                          self.spec.num_draft_tokens, self.spec.num_accepted_tokens, self.lookahead_rows,
                          accepted_per_position=self.accepted_per_position)


def summed(counts: list[list[int]]) -> list[int]:
    """Lists of counts of different lengths, added index by index."""
    total = [0] * max(map(len, counts), default=0)
    for row in counts:
        for i, count in enumerate(row):
            total[i] += count
    return total


def acceptance_by_depth(accepted_per_position: list[int], num_drafts: int) -> list[float]:
    """Per depth d from 1: the share of NUM_DRAFTS verified drafts whose first d drafted tokens the target accepted
    (a draft's token at depth d is accepted only with its first d - 1; the shares sum to the mean acceptance length
    less one)."""
    return [round(count / num_drafts, 3) for count in accepted_per_position] if num_drafts else []


def generate_together(runners: Mapping[Key, object], prompt_ids: list[int],
                      max_new_tokens: int) -> dict[Key, Generation]:
    """Every runner's answer to one prompt. The engines' requests take turns a step at a time, the next step always
    the one of the request with the fewest seconds so far, so that whatever slows the machine for a while slows each
    of them for as long: on this shared 2-core host, whole answers taken in turns by four identical engines differed
    by up to 4 % in tokens per second, steps taken in turns by 0.6 %. Other runners (transformers' `generate`, a
    peer server) answer whole, in RUNNERS' order."""
    requests = {key: runner.start(prompt_ids, max_new_tokens) for key, runner in runners.items()
                if isinstance(runner, EngineRunner)}
    running = [key for key, request in requests.items() if not request.done]
    while running:
        key = min(running, key=lambda k: requests[k].seconds)
        requests[key].step()
        if requests[key].done:
            running.remove(key)
    return {key: requests[key].finish() if key in requests else runner.generate(prompt_ids, max_new_tokens)
            for key, runner in runners.items()}


class HFRunner:
    """transformers' `generate`, greedy, optionally with prompt lookup decoding; counts its forwards."""

    def __init__(self, loaded: LoadedModel, prompt_lookup: bool) -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.eos_token_ids = loaded.eos_token_ids
        self.prompt_lookup = prompt_lookup
        self._forward_lengths: list[int] = []  # [num_forwards] input tokens of each forward
        self.model.register_forward_pre_hook(self._record_forward, with_kwargs=True)

    def _record_forward(self, module, args, kwargs) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None:
            self._forward_lengths.append(input_ids.shape[-1])

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        extra = {"prompt_lookup_num_tokens": HF_PLD_NUM_TOKENS} if self.prompt_lookup else {}
        self._forward_lengths = []
        input_ids = torch.tensor([prompt_ids], device=self.device)
        start = time.perf_counter()
        out = self.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=self.eos_token_ids, pad_token_id=self.eos_token_ids[0], **extra,
        )
        seconds = time.perf_counter() - start
        token_ids = out[0, len(prompt_ids):].tolist()
        return self._with_draft_counts(Generation(token_ids, seconds))

    def _with_draft_counts(self, gen: Generation) -> Generation:
        """Each decode forward yields its accepted candidates plus one token."""
        decode_lengths = self._forward_lengths[1:]
        gen.num_forwards = len(self._forward_lengths)
        gen.num_drafts = sum(1 for n in decode_lengths if n > 1)
        gen.drafted_tokens = sum(n - 1 for n in decode_lengths)
        gen.accepted_tokens = max(len(gen.token_ids) - len(self._forward_lengths), 0)
        return gen
