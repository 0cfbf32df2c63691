"""Runs the forwards the scheduler decided; owns the model and the KV caches."""
from __future__ import annotations

import torch

from engine.kv_cache import RequestKVCache
from engine.model_loader import LoadedModel
from scheduler.scheduler import ScheduledRequest


class ModelRunner:
    def __init__(self, loaded: LoadedModel) -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.caches: dict[str, RequestKVCache] = {}

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> list[torch.Tensor]:
        """One forward per request; returns each request's [num_logits, vocab] float32 logits on the CPU."""
        return [self._forward(item) for item in scheduled]

    def _forward(self, item: ScheduledRequest) -> torch.Tensor:
        cache = self.caches.setdefault(item.req.request_id, RequestKVCache())
        if cache.num_tokens < item.req.num_computed_tokens:
            raise RuntimeError(f"KV cache of {item.req.request_id} is behind the scheduler's record")
        cache.truncate(item.req.num_computed_tokens)  # drop the KV of rejected drafts
        return self.forward_tokens(cache, item.input_token_ids, item.num_logits)

    def forward_tokens(self, cache: RequestKVCache, token_ids: list[int], num_logits: int) -> torch.Tensor:
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=num_logits)
        return out.logits[0].float().cpu()  # [num_logits, vocab]

    def free(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
