"""One packed forward over every scheduled request, its KV in the paged pool."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.paged_attention import (
    ATTENTION_NAME, MAX_GROUPED_QUERY_LEN, FlashMetadata, PackedBatch, PagedKVPool, build_group, in_place_span,
)
from scheduler.kv_blocks import KVBlockManager

# Contexts at least this long are read in place when their slots are contiguous; shorter ones are cheaper to
# gather into one padded call than to attend one call each (measured on CPU: at 16 requests the two cost the same
# near 340 positions, and at 650 positions in place takes ~0.65x the time of gathering).
IN_PLACE_MIN_CONTEXT = 256


@dataclass
class ForwardItem:
    """One request's part of a packed forward."""

    request_id: str
    token_ids: list[int]  # new tokens: a prefill chunk, or the last token plus drafts
    num_computed: int  # positions already in the pool before these tokens
    num_logits: int  # next-token distributions wanted, for the last `num_logits` new tokens

    @property
    def context_len(self) -> int:
        return self.num_computed + len(self.token_ids)


class PackedModelRunner:
    def __init__(
        self, model: torch.nn.Module, device: torch.device, pool: PagedKVPool, backend: str = "sdpa",
        in_place_min_context: int = IN_PLACE_MIN_CONTEXT,
    ) -> None:
        self.model = model
        self.device = device
        self.pool = pool
        self.backend = backend
        self.in_place_min_context = in_place_min_context
        self.heads_per_kv_head = model.config.num_attention_heads // model.config.num_key_value_heads
        model.set_attn_implementation(ATTENTION_NAME)

    @torch.inference_mode()
    def execute(self, items: list[ForwardItem], blocks: KVBlockManager) -> list[torch.Tensor]:
        """Per item its [num_logits, vocab] float32 logits on the CPU.

        The block manager must already cover every item's context.
        """
        token_ids, positions, write_slots, keep, starts = [], [], [], [], []
        for item in items:
            starts.append(len(token_ids))
            token_ids += item.token_ids
            positions += range(item.num_computed, item.context_len)
            write_slots += blocks.slots(item.request_id, item.num_computed, item.context_len)
            keep += range(len(token_ids) - item.num_logits, len(token_ids))
        batch = PackedBatch(self.pool, self._tensor(write_slots), [])
        if self.backend == "flash":
            batch.flash = self._flash_metadata(items, blocks)
        else:
            batch.spans, gathered = self._in_place_spans(items, starts, blocks)
            batch.groups = self._groups(gathered, items, starts, blocks)
        out = self.model(
            input_ids=self._tensor(token_ids)[None], position_ids=self._tensor(positions)[None],
            use_cache=False, logits_to_keep=self._tensor(keep), packed_batch=batch,
        )
        logits = out.logits[0].float().cpu()  # [len(keep), vocab]
        return list(torch.split(logits, [item.num_logits for item in items]))

    def _in_place_spans(self, items: list[ForwardItem], starts: list[int], blocks: KVBlockManager) -> tuple[list, list[int]]:
        """Spans of the items whose long context lies in consecutive slots, and the indices of the other items."""
        spans, gathered = [], []
        for i, item in enumerate(items):
            first_slot = None
            if item.context_len >= self.in_place_min_context:
                first_slot = blocks.contiguous_first_slot(item.request_id, item.context_len)
            if first_slot is None:
                gathered.append(i)
            else:
                spans.append(in_place_span(
                    starts[i], len(item.token_ids), first_slot, item.context_len, self.heads_per_kv_head, self.device
                ))
        return spans, gathered

    def _groups(self, indices: list[int], items: list[ForwardItem], starts: list[int], blocks: KVBlockManager) -> list:
        """Short requests (decoding, verifying drafts) share one attention call; each long prefill chunk has its own."""
        short = [i for i in indices if len(items[i].token_ids) <= MAX_GROUPED_QUERY_LEN]
        long = [[i] for i in indices if len(items[i].token_ids) > MAX_GROUPED_QUERY_LEN]
        return [
            build_group(
                [starts[i] for i in members],
                [len(items[i].token_ids) for i in members],
                [items[i].context_len for i in members],
                [blocks.block_tables[items[i].request_id] for i in members],
                blocks.block_size,
                self.heads_per_kv_head,
                self.device,
            )
            for members in ([short] if short else []) + long
        ]

    def _flash_metadata(self, items: list[ForwardItem], blocks: KVBlockManager) -> FlashMetadata:
        tables = [blocks.block_tables[item.request_id] for item in items]
        width = max(len(table) for table in tables)
        return FlashMetadata(
            cu_seqlens_q=self._cumulative([len(item.token_ids) for item in items]),
            cu_seqlens_k=self._cumulative([item.context_len for item in items]),
            max_seqlen_q=max(len(item.token_ids) for item in items),
            max_seqlen_k=max(item.context_len for item in items),
            block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=self.device),
        )

    def _cumulative(self, lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0] + lengths, dtype=torch.int32, device=self.device).cumsum(0, dtype=torch.int32)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
