"""One packed forward over every scheduled request, its KV in the paged pool."""
from __future__ import annotations

import torch

from engine.paged_attention import ATTENTION_NAME, PackedBatch, PagedKVPool
from scheduler.kv_blocks import KVBlockManager


class PackedModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, pool: PagedKVPool) -> None:
        self.model = model
        self.device = device
        self.pool = pool
        model.set_attn_implementation(ATTENTION_NAME)

    @torch.inference_mode()
    def execute(self, items: list[tuple[str, list[int], int, int]], blocks: KVBlockManager) -> list[torch.Tensor]:
        """items: (request id, new token ids, num computed positions, num logits wanted) per request.

        The block manager must already cover every request's positions. Returns per
        request its [num_logits, vocab] float32 logits on the CPU.
        """
        token_ids, positions, write_slots, read_slots, starts, keep = [], [], [], [], [0], []
        for request_id, new_ids, num_computed, num_logits in items:
            end = num_computed + len(new_ids)
            token_ids += new_ids
            positions += range(num_computed, end)
            write_slots += blocks.slots(request_id, num_computed, end)
            read_slots.append(self._tensor(blocks.slots(request_id, 0, end)))
            starts.append(starts[-1] + len(new_ids))
            keep += range(starts[-1] - num_logits, starts[-1])
        batch = PackedBatch(self.pool, starts, self._tensor(write_slots), read_slots)
        out = self.model(
            input_ids=self._tensor(token_ids)[None], position_ids=self._tensor(positions)[None],
            use_cache=False, logits_to_keep=self._tensor(keep), packed_batch=batch,
        )
        logits = out.logits[0].float().cpu()  # [len(keep), vocab]
        sizes = [num_logits for *_, num_logits in items]
        return list(torch.split(logits, sizes))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
