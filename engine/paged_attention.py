"""Paged KV pool and the attention function of a packed, ragged forward.

All running requests' new tokens travel in one sequence `[1, total_new_tokens]`.
Each layer writes its new keys and values into the shared pool at the slots the
scheduler's block tables give, then attends, request by request, over that
request's own slots. Registered through transformers' public AttentionInterface,
so the model code itself stays transformers'.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "specserve_paged"


class PagedKVPool:
    """Keys and values of every layer: `[num_layers, num_slots, kv_heads, head_dim]`, slot = block * size + offset."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """key, value: [1, kv_heads, n, head_dim]; slots: [n]."""
        self.keys[layer, slots] = key[0].transpose(0, 1)
        self.values[layer, slots] = value[0].transpose(0, 1)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [n] -> keys and values [1, kv_heads, n, head_dim]."""
        return self.keys[layer, slots].transpose(0, 1)[None], self.values[layer, slots].transpose(0, 1)[None]


@dataclass
class PackedBatch:
    """Where each request's tokens sit in the packed sequence and in the pool."""

    pool: PagedKVPool
    query_starts: list[int]  # [num_reqs + 1] offsets of each request's new tokens in the packed sequence
    write_slots: torch.Tensor  # [total_new_tokens] pool slots of the new tokens
    read_slots: list[torch.Tensor]  # per request: [context_len] slots of all its positions, new ones included


def causal_offset_mask(num_queries: int, context_len: int, device: torch.device) -> torch.Tensor | None:
    """[num_queries, context_len] True where query i (position context_len - num_queries + i) may look."""
    if num_queries == 1:
        return None  # the last position sees everything
    query_positions = torch.arange(context_len - num_queries, context_len, device=device)[:, None]
    return torch.arange(context_len, device=device)[None, :] <= query_positions


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_batch: PackedBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, total, head_dim]; key, value [1, kv_heads, total, head_dim] -> [1, total, heads, head_dim]."""
    if packed_batch is None:
        raise ValueError(f"{ATTENTION_NAME} attention needs a packed_batch argument")
    layer, starts = module.layer_idx, packed_batch.query_starts
    packed_batch.pool.write(layer, key, value, packed_batch.write_slots)
    outputs = []
    for r, slots in enumerate(packed_batch.read_slots):
        q = query[:, :, starts[r]:starts[r + 1]]
        k, v = packed_batch.pool.read(layer, slots)
        mask = causal_offset_mask(q.shape[2], k.shape[2], q.device)
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
