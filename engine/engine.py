"""The engine: one `step()` schedules, runs one forward per request, verifies, updates and drafts."""
from __future__ import annotations

import time

import torch

from drafters.registry import build_drafter
from engine.config import EngineConfig
from engine.model_loader import load_model
from engine.profiler import profile_forward_latency
from engine.runner import ModelRunner
from engine.sampler import Verifier
from engine.wire import EngineOutputs, EngineReady, EngineRequest, RequestOutput, StepStats
from scheduler.latency import LatencyModel
from scheduler.request import Request
from scheduler.scheduler import Scheduler


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        torch.manual_seed(config.model.seed)
        loaded = load_model(config.model)
        self.model_name = loaded.source.name
        self.max_model_len = loaded.max_model_len
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = loaded.model.config.vocab_size
        self.runner = ModelRunner(loaded)
        self.latency_profile = profile_forward_latency(self.runner, self.vocab_size, self.max_model_len)  # s by num tokens
        self.scheduler = Scheduler(
            config.scheduler, self.max_model_len, self.eos_token_ids, LatencyModel(self.latency_profile)
        )
        self.drafter = build_drafter(config.spec)
        self.verifier = Verifier()

    def ready_message(self) -> EngineReady:
        return EngineReady(
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            latency_ms_by_num_tokens={n: s * 1000 for n, s in self.latency_profile.items()},
        )

    # --- requests in ----------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> RequestOutput | None:
        """Queue a request; returns an error output instead if it cannot be served."""
        error = self._validate(request)
        if error:
            return RequestOutput(request.request_id, [], finish_reason="error", error=error)
        req = Request(request.request_id, list(request.prompt_token_ids), request.sampling, request.session_id)
        self.scheduler.add_request(req)
        if self.drafter:
            self.drafter.begin(req)
        return None

    def _validate(self, request: EngineRequest) -> str | None:
        prompt = request.prompt_token_ids
        if not prompt:
            return "the prompt is empty"
        if len(prompt) >= self.max_model_len:
            return f"the prompt has {len(prompt)} tokens; this model's context is {self.max_model_len}"
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            return f"prompt token ids must lie in [0, {self.vocab_size})"
        if request.sampling.max_tokens < 1:
            return "max_tokens must be at least 1"
        return None

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        self._release(req)
        return RequestOutput(request_id, [], finish_reason="abort", num_prompt_tokens=req.num_prompt_tokens, spec=req.spec)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # --- the step -------------------------------------------------------------------------
    def step(self) -> EngineOutputs:
        start = time.perf_counter()
        sched_out = self.scheduler.schedule()
        logits = self.runner.execute(sched_out.scheduled)
        sampled = [
            self.verifier.verify(item.req.request_id, item.req.sampling, item_logits, item.draft_token_ids)
            for item, item_logits in zip(sched_out.scheduled, logits)
        ]
        outputs, stats = self.scheduler.update(sched_out, sampled)
        self._after_update(sched_out.scheduled, outputs)
        stats.step_seconds = time.perf_counter() - start
        return EngineOutputs(outputs=outputs, stats=stats)

    def _after_update(self, scheduled: list, outputs: list[RequestOutput]) -> None:
        running = []
        for item, output in zip(scheduled, outputs):
            if item.req.is_finished:
                self._release(item.req)
            else:
                running.append(item.req)
                if self.drafter:
                    self.drafter.extend(item.req, output.new_token_ids)
        if self.drafter and running:
            self.scheduler.set_drafts(running, self.drafter.propose(running))

    def _release(self, req: Request) -> None:
        self.runner.free(req.request_id)
        self.verifier.finish(req.request_id)
        if self.drafter:
            self.drafter.finish(req)
