"""The engine: one `step()` schedules, runs one packed forward, verifies, updates and drafts."""
from __future__ import annotations

import atexit
import gc
import time

import torch

from drafters.base import Draft
from drafters.registry import build_drafter
from drafters.tree import depths
from engine.batching import forward_batch
from engine.config import CacheConfig, EngineConfig
from engine.drafter_context import drafter_context
from engine.grammar import GrammarError, Grammars
from engine.logprobs import PromptLogprobs
from engine.model.draft_model import (
    DraftForward,
    DraftModel,
    HeadForward,
    Reserve,
    draft_pool,
    load_draft_model,
    reserve_nothing,
    shipped_head,
)
from engine.model.eagle3 import Eagle3Head
from engine.model.forward import ForwardBatch, ForwardOutput, RowChoice
from engine.model.model_loader import LoadedModel, load_model
from engine.model.packed_runner import PackedModelRunner
from engine.model.paged_attention import FLASH_BLOCK_SIZE, PagedKVPool, kv_shape, resolve_attention_backend
from engine.model.profiler import profile_forward_latency, profile_path_seconds
from engine.model.tokenizer import load_tokenizer
from engine.speculation import Speculation
from engine.verifier import Verifier
from engine.wire import EngineError, EngineOutputs, EngineReady, EngineRequest, RequestOutput, StepStats, TokenLogprob
from scheduler.kv_blocks import KVBlockManager
from scheduler.latency import LatencyModel
from scheduler.records import RequestUpdate, ScheduledRequest, SchedulerOutput, StepUpdate, Verification
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.sessions import SessionStore

DEFAULT_BLOCK_SIZE = 16
# objects frozen after start-up (`freeze_start_up_objects`) are handed back at exit, so that the interpreter's
# teardown frees them (extension types report them leaked otherwise)
atexit.register(gc.unfreeze)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        torch.manual_seed(config.model.seed)
        loaded = load_model(config.model)
        self.model_name = loaded.source.name
        self.weights = loaded.weights  # how the Linear layers keep their weights (engine/model/weights.py)
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = loaded.model.config.vocab_size
        backend = resolve_attention_backend(config.cache.attention_backend, loaded.device)
        draft_spec = config.model.draft_model or shipped_head(loaded.source.name, config.spec.drafter)
        draft = load_draft_model(draft_spec, loaded, config.model) if draft_spec else None
        companion = _load_companion(config.model, loaded)
        extra_bytes = sum(model.kv_bytes_per_position for model in (draft, companion) if model)
        pool, blocks = _allocate_kv_pool(loaded, config.cache, backend, extra_bytes)
        self.max_model_len = min(loaded.max_model_len, blocks.num_blocks * blocks.block_size)
        self.runner = PackedModelRunner(loaded.model, loaded.device, pool, blocks.block_size, backend)
        self.runner.capture_graphs(blocks.num_blocks, -(-self.max_model_len // blocks.block_size),
                                   config.cache.cuda_graph_max_tokens)  # the pool's spare block: the padding rows'
        # seconds by number of tokens
        self.latency_profile = profile_forward_latency(self.runner, blocks, self.vocab_size, self.max_model_len)
        self.path_seconds_per_position = profile_path_seconds(self.runner, blocks, self.vocab_size, self.max_model_len)
        self.num_draft_tokens = config.spec.num_draft_tokens
        self.draft_forward = (
            self._draft_forward(draft, pool, blocks, backend, loaded, self._reserve_model_drafts) if draft else None
        )
        self.companion_forward = self._draft_forward(companion, pool, blocks, backend, loaded) if companion else None
        sessions = SessionStore(config.sessions, blocks) if config.sessions.mode != "off" else None
        self.scheduler = Scheduler(
            config.scheduler, self.max_model_len, self.eos_token_ids, blocks,
            LatencyModel(self.latency_profile, self.path_seconds_per_position), sessions=sessions,
            draft_latency=LatencyModel(self.draft_forward.latency_profile) if draft else None,
            companion_latency=LatencyModel(self.companion_forward.latency_profile) if companion else None,
            companion_in_lockstep=bool(companion and self.companion_forward.is_head),
        )
        context = drafter_context(loaded, config.model, self.draft_forward, self.companion_forward)
        self.cache_dir, self.model_fingerprint = context.cache_dir, context.model_fingerprint
        self.speculation = Speculation(build_drafter(config.spec, context))
        self.max_session_host_bytes = int(config.sessions.host_memory_mib * 2**20)
        self.grammars = Grammars(lambda: load_tokenizer(config.model), self.vocab_size, self.eos_token_ids)
        self.verifier = Verifier(self.grammars)
        self.prompt_logprobs = PromptLogprobs()

    def _draft_forward(
        self, draft: DraftModel, pool: PagedKVPool, blocks: KVBlockManager, backend: str, loaded: LoadedModel,
        reserve: Reserve = reserve_nothing,
    ) -> DraftForward:
        """A draft (or companion) model's runner over its pool (the target's, for an early exit), its latency
        profiled like the target's."""
        runner = PackedModelRunner(
            draft.model, loaded.device, draft_pool(draft, pool, loaded.device), blocks.block_size, backend
        )
        profile = profile_forward_latency(runner, blocks, self.vocab_size, self.max_model_len)
        if isinstance(draft.model, Eagle3Head):
            return HeadForward(draft, runner, blocks, profile, loaded.model.config, reserve,
                               lambda probabilities: self.scheduler.chains_continuing(probabilities))
        return DraftForward(draft, runner, blocks, profile, reserve)

    def ready_message(self) -> EngineReady:
        return EngineReady(
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            latency_ms_by_num_tokens={n: s * 1000 for n, s in self.latency_profile.items()},
            num_kv_blocks=self.scheduler.blocks.num_blocks,
            kv_block_size=self.scheduler.blocks.block_size,
            weights=self.weights,
            vocab_size=self.vocab_size,
        )

    # --- requests in ----------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> RequestOutput | None:
        """Queue a request; returns an error output instead if it cannot be served.

        Raises scheduler.admission.QueueFullError when the queue is full.
        """
        error = self._validate(request) or self._begin_grammar(request)
        if error:
            return RequestOutput(
                request.request_id, [], finish_reason="error", error=EngineError("invalid_request", error)
            )
        # prompt log-probabilities are computed afresh; a drafter that reads what the target computed at every
        # position must see the prompt computed
        computes_prompt = request.sampling.prompt_logprobs is not None or self.speculation.needs_every_position
        req = Request(
            request.request_id, list(request.prompt_token_ids), request.sampling, request.session_id,
            prompt_source=None if computes_prompt else request.prompt_source, continues=request.continues,
        )
        try:
            session_key = self.scheduler.add_request(req)
        except Exception:
            self.grammars.finish(request.request_id)
            raise
        scores_prompt = request.sampling.prompt_logprobs is not None
        resumed = self.speculation.begin(req, None if scores_prompt else session_key)
        if req.num_cached_tokens and (scores_prompt or not resumed and self.speculation.needs_every_position):
            self.scheduler.drop_cached_prefix(req)  # never read: its drafter did not see it computed, or it is scored
        if scores_prompt:
            self.prompt_logprobs.begin(req.request_id, req.num_prompt_tokens)
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
        if any(not 0 <= token_id < self.vocab_size for token_id in request.sampling.logit_bias):
            return f"logit_bias token ids must lie in [0, {self.vocab_size})"
        return None

    def _begin_grammar(self, request: EngineRequest) -> str | None:
        """Start the request's grammar matcher; the reason when its grammar does not compile."""
        if request.sampling.grammar is None:
            return None
        try:
            self.grammars.begin(request.request_id, request.sampling.grammar)
        except GrammarError as exc:
            return f"the grammar does not compile: {exc}"
        return None

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        self._release(req)
        return RequestOutput(
            request_id, [], finish_reason="abort", num_prompt_tokens=req.num_prompt_tokens, spec=req.spec,
            num_cached_tokens=req.num_cached_tokens,
        )

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def expire_idle_sessions(self) -> StepStats | None:
        """Between steps, while idle: evict sessions past their TTL; their stats when any went."""
        if not self.scheduler.sessions:
            return None
        self._expire_sessions()
        if not self.scheduler.sessions.stats.evictions:
            return None
        stats = StepStats(kv_cache_usage=self.scheduler.blocks.usage)
        self._add_cache_stats(stats)
        return stats

    # --- the step -------------------------------------------------------------------------
    def step(self) -> EngineOutputs:
        start = time.perf_counter()
        self._expire_sessions()
        sched_out = self.scheduler.schedule()
        batch, model_out = self._execute(sched_out)
        prompt_logprobs = self._score_prompts(sched_out.scheduled, model_out)
        results, logprobs = self._verify(sched_out.scheduled, model_out)
        update = self.scheduler.update(sched_out, results)
        self.runner.move_kv(update.kv_moves)
        draft_seconds = self._after_update(sched_out, batch, model_out, results, update)
        update.stats.step_seconds = time.perf_counter() - start
        self.scheduler.observe_step_seconds(sched_out, update.stats.step_seconds - draft_seconds)
        outputs = [
            _wire_output(u, logprobs.get(u.request_id), prompt_logprobs.get(u.request_id)) for u in update.updates
        ]
        return EngineOutputs(outputs=outputs, stats=update.stats)

    def _execute(self, sched_out: SchedulerOutput) -> tuple[ForwardBatch, ForwardOutput | None]:
        self.speculation.preempt(sched_out.preempted)
        batch = forward_batch(sched_out.scheduled, self.runner.block_size, self.speculation.captures)
        for item, forward in zip(sched_out.scheduled, batch.items):
            forward.prompt_rows = self.prompt_logprobs.rows(item.req.request_id, item.num_computed,
                                                            item.num_real_tokens)
        if self.runner.samples_on_device:
            self._sample_on_device(sched_out.scheduled, batch)
        return batch, (self.runner.execute(batch) if batch.items else None)

    def _score_prompts(
        self, scheduled: list[ScheduledRequest], model_out: ForwardOutput | None
    ) -> dict[str, list[TokenLogprob | None]]:
        """Record the prompt log-probabilities this step computed; those of prompts it completed, by request id."""
        completed = {}
        for index, item in enumerate(scheduled):
            req = item.req
            logits = model_out.prompt_logits[index] if model_out is not None else None
            if logits is not None:
                self.prompt_logprobs.record(req.request_id, item.num_computed, logits, req.prompt_token_ids,
                                            req.sampling.prompt_logprobs)
            if item.reaches_end:
                entries = self.prompt_logprobs.take(req.request_id)
                if entries is not None:
                    completed[req.request_id] = entries
        return completed

    def _sample_on_device(self, scheduled: list[ScheduledRequest], batch: ForwardBatch) -> None:
        """Sampled requests that process no logits, ask for no log-probabilities and verify no model draft get their
        rows' samples drawn where the logits are: each row at its depth's uniform."""
        for item, forward in zip(scheduled, batch.items):
            params = item.req.sampling
            if (forward.choice is not None or params.greedy or params.processes_logits or params.logprobs is not None
                    or not forward.logit_rows or self._draft_probs(item) is not None):
                continue
            uniforms = self.verifier.uniforms(item.req, item.draft_parents)
            forward.choice = RowChoice(params.temperature, params.top_k, params.top_p,
                                       [uniforms[0]] + [uniforms[depth] for depth in depths(item.draft_parents)])

    def _verify(
        self, scheduled: list[ScheduledRequest], model_out: ForwardOutput | None,
    ) -> tuple[list[Verification], dict[str, list[TokenLogprob]]]:
        """Each request's verification, and the emitted tokens' log-probabilities of those that asked."""
        results, logprobs = [], {}
        for index, item in enumerate(scheduled):
            if not item.num_logits:
                results.append(Verification([]))
                continue
            chosen = model_out.chosen[index]
            if chosen is not None:  # nothing processed: the runner sent the target's token at each row only
                results.append(self.verifier.verify_chosen(item.req, chosen, item.draft_token_ids, item.draft_parents))
                continue
            result, request_logprobs = self.verifier.verify(
                item.req, model_out.logits[index], item.draft_token_ids, item.draft_parents, self._draft_probs(item),
            )
            results.append(result)
            if request_logprobs is not None:
                logprobs[item.req.request_id] = request_logprobs
        return results, logprobs

    def _draft_probs(self, item: ScheduledRequest) -> torch.Tensor | None:
        """[num verified, vocab] the draft distributions of the verified nodes, for drafts sampled from a model."""
        probs = self.speculation.distributions(item.req) if item.num_draft_tokens else None
        return probs[item.draft_nodes] if probs is not None else None

    def _after_update(
        self, sched_out: SchedulerOutput, batch: ForwardBatch, model_out: ForwardOutput | None,
        results: list[Verification], update: StepUpdate,
    ) -> float:
        """Show the drafter what the step did, and draft for the next; returns the seconds spent drafting."""
        self.speculation.observe(sched_out.scheduled, batch, model_out, results)
        by_id = {item.req.request_id: item.req for item in sched_out.scheduled}
        for request_update in update.updates:
            req = by_id[request_update.request_id]
            if req.is_finished:
                self._release(req)
            else:
                self.speculation.extend(req, request_update.new_token_ids)
        decoding = [req for req in self.scheduler.running if req.is_decoding]
        drafting = self.scheduler.drafting(decoding)
        start = time.perf_counter()
        self.scheduler.set_drafts(drafting, self._grammatical(drafting, self.speculation.propose(drafting)))
        resting = self.scheduler.resting(decoding)
        self.scheduler.set_drafts(resting, self._grammatical(resting, self.speculation.propose_resting(resting)))
        draft_seconds = 0.0
        if self.draft_forward:
            draft_seconds = time.perf_counter() - start
            companion = self.companion_forward.take_forwards() if self.companion_forward else []
            self.scheduler.observe_drafting_seconds(draft_seconds, self.draft_forward.take_forwards(), companion)
        self._add_cache_stats(update.stats)
        return draft_seconds

    def _reserve_model_drafts(
        self, reqs: list[Request], beside: list[tuple[Request, Draft]], unread: dict[str, int],
    ) -> dict[str, int]:
        """For the requests about to draft with the draft model, how many tokens each may draft (their blocks reserved),
        beside the rest of the batch's drafts; UNREAD: what the model has not read of each."""
        return self.scheduler.reserve_model_drafts(reqs, self.num_draft_tokens, "draft", beside,
                                                   knows_acceptance=self.draft_forward.is_head, unread=unread)

    def _grammatical(self, reqs: list[Request], drafts: list[Draft]) -> list[Draft]:
        """Drafts cut to what each request's grammar allows, so that forbidden tokens are never verified."""
        return [
            self.grammars.cut_draft(req.request_id, draft) if self.grammars.has(req.request_id) else draft
            for req, draft in zip(reqs, drafts)
        ]

    def _release(self, req: Request) -> None:
        self.verifier.finish(req.request_id)
        self.prompt_logprobs.finish(req.request_id)
        self.speculation.finish(req, self.scheduler.end_turn(req.request_id))

    def _expire_sessions(self) -> None:
        sessions = self.scheduler.sessions
        if sessions:
            sessions.expire()

    def _bound_session_memory(self) -> int:
        """Cached sessions' host memory (histories, block lists, drafter states) kept within --session-host-memory,
        the least recently used evicted first; returns what they hold."""
        sessions = self.scheduler.sessions
        held = sessions.host_bytes() + self.speculation.session_state_bytes()
        while held > self.max_session_host_bytes and sessions.num_sessions:
            sessions.evict_least_recent()
            self.speculation.forget_sessions(sessions.take_evicted_keys())
            held = sessions.host_bytes() + self.speculation.session_state_bytes()
        return held

    def _add_cache_stats(self, stats: StepStats) -> None:
        sessions = self.scheduler.sessions
        if sessions:
            self.speculation.forget_sessions(sessions.take_evicted_keys())
            stats.session_host_bytes = self._bound_session_memory()
            counts = sessions.take_stats()
            stats.session_hits, stats.session_misses = counts.hits, counts.misses
            stats.conversation_hits, stats.conversation_misses = counts.conversation_hits, counts.conversation_misses
            stats.session_reused_tokens, stats.session_evictions = counts.reused_tokens, counts.evictions
            stats.num_sessions = sessions.num_sessions
        stats.drafter_state_bytes = self.speculation.reported_state_bytes()


def _wire_output(
    update: RequestUpdate, logprobs: list[TokenLogprob] | None, prompt_logprobs: list[TokenLogprob | None] | None,
) -> RequestOutput:
    """LOGPROBS cover every token the walk emitted; the update keeps those before a stop."""
    return RequestOutput(
        request_id=update.request_id, new_token_ids=update.new_token_ids, finish_reason=update.finish_reason,
        num_prompt_tokens=update.num_prompt_tokens, spec=update.spec, num_cached_tokens=update.num_cached_tokens,
        logprobs=logprobs[:len(update.new_token_ids)] if logprobs is not None else None,
        prompt_logprobs=prompt_logprobs,
    )


def freeze_start_up_objects() -> None:
    """Keep what the engines built so far hold (the model's modules, the tokenizer, the profiles: ~480,000 objects)
    out of the collector's full passes: each walked them all, 0.3 s once every ~40 s of decoding at B = 16 here, a
    stall of every request in the batch. Their garbage is collected first. For a process whose engines live as long
    as it does (the engine process, a benchmark's): what is frozen is never collected, cycles included."""
    gc.collect()
    gc.freeze()


def _load_companion(config, loaded: LoadedModel) -> DraftModel | None:
    if not config.companion_model:
        return None
    if not config.draft_model:
        raise ValueError("--companion-model scores a draft model's tokens: pass --draft-model too")
    return load_draft_model(config.companion_model, loaded, config, role="companion")


def _allocate_kv_pool(
    loaded: LoadedModel, cache: CacheConfig, backend: str, extra_bytes_per_position: int = 0,
) -> tuple[PagedKVPool, KVBlockManager]:
    """The paged pool sized from the memory budget, and the block manager that hands out its blocks. The budget is
    split by bytes per position with the pools of the other models (EXTRA_BYTES_PER_POSITION), which have as many
    slots."""
    shape = kv_shape(loaded.model.config)
    dtype = next(loaded.model.parameters()).dtype
    block_size = cache.block_size or (FLASH_BLOCK_SIZE if backend == "flash" else DEFAULT_BLOCK_SIZE)
    if backend == "flash" and block_size % FLASH_BLOCK_SIZE:
        raise ValueError(f"the flash attention backend needs a block size that is a multiple of {FLASH_BLOCK_SIZE}")
    bytes_per_position = PagedKVPool.bytes_per_slot(*shape, dtype) + extra_bytes_per_position
    num_blocks = int(cache.kv_cache_memory_gib * 2**30) // (bytes_per_position * block_size)
    if num_blocks * block_size < 64:
        raise ValueError(
            f"--kv-cache-memory {cache.kv_cache_memory_gib} GiB holds fewer than 64 positions of this model"
        )
    # one spare block past the manager's: CUDA graphs' padding rows write their KV there (engine/model/cuda_graphs.py)
    pool = PagedKVPool(shape[0], (num_blocks + 1) * block_size, shape[1], shape[2], dtype, loaded.device)
    return pool, KVBlockManager(num_blocks, block_size)
