"""Per-request KV cache that can roll back rejected draft tokens.

transformers' `DynamicCache` concatenates the whole history on every step; this
cache writes new keys and values into a buffer that grows by doubling, so a step
copies only its own tokens, and rolling back is a slice.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class GrowableLayer(DynamicLayer):
    """One layer's keys and values: views `[1, kv_heads, seq_len, head_dim]` into a larger buffer."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = key_states.new_empty(0)  # [1, kv_heads, capacity, head_dim]
        self._value_buffer = value_states.new_empty(0)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        self._ensure_capacity(end, key_states, value_states)
        self._key_buffer[..., start:end, :] = key_states
        self._value_buffer[..., start:end, :] = value_states
        self.keys = self._key_buffer[..., :end, :]
        self.values = self._value_buffer[..., :end, :]
        return self.keys, self.values

    def _ensure_capacity(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = self._key_buffer.shape[-2] if self._key_buffer.dim() == 4 else 0
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity, 256)
        self._key_buffer = self._grow(self._key_buffer, key_states, new_capacity)
        self._value_buffer = self._grow(self._value_buffer, value_states, new_capacity)

    def _grow(self, buffer: torch.Tensor, like: torch.Tensor, capacity: int) -> torch.Tensor:
        shape = (*like.shape[:-2], capacity, like.shape[-1])
        grown = like.new_empty(shape)
        length = self.get_seq_length()
        if length:
            grown[..., :length, :] = buffer[..., :length, :]
        return grown


class RequestKVCache(Cache):
    """The KV cache of one request; `truncate` rolls back to a shorter prefix."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=GrowableLayer)

    @property
    def num_tokens(self) -> int:
        return self.get_seq_length()

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` positions; forget the rest (rejected drafts)."""
        excess = self.num_tokens - num_tokens
        if excess < 0:
            raise ValueError(f"cannot truncate a {self.num_tokens}-token cache to {num_tokens} tokens")
        if excess:
            self.crop(-excess)
