"""The engine: one `step()` schedules, runs one packed forward, verifies, updates and drafts."""
from __future__ import annotations

import time

import torch

from drafters.registry import build_drafter
from engine.config import CacheConfig, EngineConfig
from engine.model_loader import LoadedModel, load_model
from engine.packed_runner import ForwardItem, PackedModelRunner
from engine.paged_attention import FLASH_BLOCK_SIZE, PagedKVPool, resolve_attention_backend
from engine.profiler import profile_forward_latency
from engine.sampler import Verifier
from engine.sessions import SessionStore
from engine.wire import EngineOutputs, EngineReady, EngineRequest, RequestOutput, StepStats
from scheduler.kv_blocks import KVBlockManager
from scheduler.latency import LatencyModel
from scheduler.request import Request
from scheduler.scheduler import Scheduler, ScheduledRequest

DEFAULT_BLOCK_SIZE = 16


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        torch.manual_seed(config.model.seed)
        loaded = load_model(config.model)
        self.model_name = loaded.source.name
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = loaded.model.config.vocab_size
        backend = resolve_attention_backend(config.cache.attention_backend, loaded.device)
        pool, blocks = _allocate_kv_pool(loaded, config.cache, backend)
        self.max_model_len = min(loaded.max_model_len, blocks.num_blocks * blocks.block_size)
        self.runner = PackedModelRunner(loaded.model, loaded.device, pool, backend)
        self.latency_profile = profile_forward_latency(self.runner, blocks, self.vocab_size, self.max_model_len)  # s by num tokens
        self.sessions = SessionStore(config.sessions, blocks) if config.sessions.mode != "off" else None
        self.scheduler = Scheduler(
            config.scheduler, self.max_model_len, self.eos_token_ids, blocks, LatencyModel(self.latency_profile),
            turn_cache=self.sessions,
        )
        self.drafter = build_drafter(config.spec)
        self.verifier = Verifier()

    def ready_message(self) -> EngineReady:
        return EngineReady(
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            latency_ms_by_num_tokens={n: s * 1000 for n, s in self.latency_profile.items()},
            num_kv_blocks=self.scheduler.blocks.num_blocks,
            kv_block_size=self.scheduler.blocks.block_size,
        )

    # --- requests in ----------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> RequestOutput | None:
        """Queue a request; returns an error output instead if it cannot be served."""
        error = self._validate(request)
        if error:
            return RequestOutput(request.request_id, [], finish_reason="error", error=error)
        req = Request(request.request_id, list(request.prompt_token_ids), request.sampling, request.session_id)
        self.scheduler.add_request(req)
        drafter_state = self.sessions.attach(req) if self.sessions else None
        if self.drafter:
            self.drafter.begin(req, drafter_state)
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
        return RequestOutput(
            request_id, [], finish_reason="abort", num_prompt_tokens=req.num_prompt_tokens, spec=req.spec,
            num_cached_tokens=req.num_cached_tokens,
        )

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def expire_idle_sessions(self) -> StepStats | None:
        """Between steps, while idle: evict sessions past their TTL; their stats when any went."""
        if not self.sessions:
            return None
        self.sessions.expire()
        if not self.sessions.stats.evictions:
            return None
        stats = StepStats(kv_cache_usage=self.scheduler.blocks.usage)
        self._add_session_stats(stats)
        return stats

    # --- the step -------------------------------------------------------------------------
    def step(self) -> EngineOutputs:
        start = time.perf_counter()
        if self.sessions:
            self.sessions.expire()
        sched_out = self.scheduler.schedule()
        items = [_forward_item(item) for item in sched_out.scheduled]
        logits = self.runner.execute(items, self.scheduler.blocks) if items else []
        sampled = [
            self.verifier.verify(item.req.request_id, item.req.sampling, item_logits, item.draft_token_ids)
            if item.num_logits else []
            for item, item_logits in zip(sched_out.scheduled, logits)
        ]
        outputs, stats = self.scheduler.update(sched_out, sampled)
        self._after_update(sched_out.scheduled, outputs)
        self._add_session_stats(stats)
        stats.step_seconds = time.perf_counter() - start
        self.scheduler.observe_step_seconds(sched_out, stats.step_seconds)
        return EngineOutputs(outputs=outputs, stats=stats)

    def _after_update(self, scheduled: list[ScheduledRequest], outputs: list[RequestOutput]) -> None:
        by_id = {item.req.request_id: item.req for item in scheduled}
        for output in outputs:
            req = by_id[output.request_id]
            if req.is_finished:
                self._release(req)
            elif self.drafter:
                self.drafter.extend(req, output.new_token_ids)
        decoding = [req for req in self.scheduler.running if req.num_uncomputed_tokens == 1]
        if self.drafter and decoding:
            self.scheduler.set_drafts(decoding, self.drafter.propose(decoding))

    def _release(self, req: Request) -> None:
        self.verifier.finish(req.request_id)
        drafter_state = self.drafter.finish(req) if self.drafter else None
        if self.sessions:
            self.sessions.end(req.request_id, drafter_state)

    def _add_session_stats(self, stats: StepStats) -> None:
        if self.sessions:
            counts = self.sessions.take_stats()
            stats.session_hits, stats.session_misses = counts.hits, counts.misses
            stats.session_reused_tokens, stats.session_evictions = counts.reused_tokens, counts.evictions
            stats.num_sessions = self.sessions.num_sessions


def _forward_item(item: ScheduledRequest) -> ForwardItem:
    return ForwardItem(item.req.request_id, item.input_token_ids, item.req.num_computed_tokens, item.num_logits)


def _allocate_kv_pool(loaded: LoadedModel, cache: CacheConfig, backend: str) -> tuple[PagedKVPool, KVBlockManager]:
    """The paged pool sized from the memory budget, and the block manager that hands out its blocks."""
    config = loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (config.num_hidden_layers, config.num_key_value_heads, head_dim)
    dtype = next(loaded.model.parameters()).dtype
    block_size = cache.block_size or (FLASH_BLOCK_SIZE if backend == "flash" else DEFAULT_BLOCK_SIZE)
    if backend == "flash" and block_size % FLASH_BLOCK_SIZE:
        raise ValueError(f"the flash attention backend needs a block size that is a multiple of {FLASH_BLOCK_SIZE}")
    num_blocks = int(cache.kv_cache_memory_gib * 2**30) // (PagedKVPool.bytes_per_slot(*shape, dtype) * block_size)
    if num_blocks * block_size < 64:
        raise ValueError(f"--kv-cache-memory {cache.kv_cache_memory_gib} GiB holds fewer than 64 positions of this model")
    pool = PagedKVPool(shape[0], num_blocks * block_size, shape[1], shape[2], dtype, loaded.device)
    return pool, KVBlockManager(num_blocks, block_size)
