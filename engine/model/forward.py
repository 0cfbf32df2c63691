"""The forward contract: plain data that says all a model runner needs, and what a forward returns.

A `ForwardBatch` is one packed forward over several sequences (one `ForwardItem` each). An item's new tokens attend to
the sequence's cached KV (KV indices [0, num_cached) of its block table, all visible) and to each other as their
attention structure says: a causal chain, or a tree, where a token sees its own ancestors only. A new token's KV index
is num_cached + its row, so a tree's nodes lie in list order after the cached context whatever their depth; its
position id is its depth's. After verification the engine moves the accepted branch's KV to the slots of its final
positions (`ModelRunner.move_kv`), as the scheduler says.

Rows of an item return, on request: logits for the verifier (`logit_rows`; or only the target's token at each, chosen
where the logits are, when the verifier needs no more: `choice`, so a GPU sends a few ids to the host instead of
full-vocabulary rows), logits for a drafter
(`drafter_rows`: look-ahead tokens, whose KV is scratch), the model's raw logits for prompt log-probabilities
(`prompt_rows`, kept on the device), the hidden state after the batch's capture layer
(`hidden_rows`), and the attention of the capture heads over the whole context (`attention_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from drafters.base import CaptureSpec
from drafters.tree import chain_parents, depths

if TYPE_CHECKING:
    import torch


@dataclass
class ForwardItem:
    token_ids: list[int]  # [n] new tokens
    positions: list[int]  # [n] their position ids
    slots: list[int]  # [n] pool slots their KV is written to: the slots of KV indices num_cached .. num_cached + n - 1
    block_table: list[int]  # the sequence's pool blocks, in KV-index order
    num_cached: int  # KV entries of the sequence before these tokens, visible to every new token
    # [n] tree: each token's parent row, -1 = the cached context only; None = causal chain
    parents: list[int] | None = None
    logit_rows: list[int] = field(default_factory=list)  # rows whose logits go to the verifier
    drafter_rows: list[int] = field(default_factory=list)  # rows whose logits go to a drafter (look-ahead tokens)
    prompt_rows: list[int] = field(default_factory=list)  # rows whose logits score the next prompt token
    hidden_rows: list[int] = field(default_factory=list)  # rows whose hidden state at the capture layer is returned
    attention_rows: list[int] = field(default_factory=list)  # rows whose attention of the capture heads is returned
    choice: RowChoice | None = None  # the runner returns each logit row's chosen token instead of its logits

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """KV entries the item's tokens may read: the cached ones and the new ones."""
        return self.num_cached + len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return self.parents is None


@dataclass
class RowChoice:
    """The target's token at each logit row of an item, for a request that processes no logits and asks for no
    log-probabilities: the argmax (greedy: temperature 0), or the inverse CDF of p (temperature, then top-k, then
    top-p; engine/sampler.py) at the row's uniform, the uniform of its depth in the draft tree (engine/verifier.py)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    uniforms: list[float] = field(default_factory=list)  # [len(logit_rows)] when sampled

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class ForwardBatch:
    items: list[ForwardItem]
    capture: CaptureSpec = field(default_factory=CaptureSpec)
    # [total new tokens, hidden] what a draft head reads beside each token, items in order (engine/model/eagle3.py)
    features: torch.Tensor | None = None


@dataclass
class ForwardOutput:
    logits: list[torch.Tensor | None]  # per item [len(logit_rows), vocab] float32 on the CPU; None with a choice
    drafter_logits: list[torch.Tensor | None]  # per item [len(drafter_rows), vocab] float32, or None when no row asked
    hidden: list[torch.Tensor | None]  # per item [len(hidden_rows), hidden_size], or None
    attention: list[torch.Tensor | None]  # per item [len(attention_rows), num capture heads, context_len], or None
    chosen: list[list[int] | None] = field(default_factory=list)  # per item its logit rows' chosen tokens, if asked
    # per item [len(prompt_rows), vocab] on the device, in the model's dtype, or None when no row asked
    prompt_logits: list[torch.Tensor | None] = field(default_factory=list)


def slots_of(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """[end - start] pool slots of KV indices start .. end - 1 of a block table."""
    return [block_table[i // block_size] * block_size + i % block_size for i in range(start, end)]


def chain_item(
    token_ids: list[int], num_cached: int, block_table: list[int], block_size: int, num_logits: int = 1,
) -> ForwardItem:
    """A causal chain after NUM_CACHED cached positions; its last NUM_LOGITS rows return logits."""
    n = len(token_ids)
    return ForwardItem(
        token_ids, list(range(num_cached, num_cached + n)),
        slots_of(block_table, block_size, num_cached, num_cached + n),
        block_table, num_cached, logit_rows=list(range(n - num_logits, n)),
    )


def tree_item(
    token_ids: list[int], parents: list[int], num_cached: int, block_table: list[int], block_size: int,
    logit_rows: list[int],
) -> ForwardItem:
    """A tree after NUM_CACHED cached positions; parents[i] = -1 attaches token i to the cached context."""
    n = len(token_ids)
    chain = parents == chain_parents(n)
    positions = [num_cached + depth - 1 for depth in depths(parents)]
    return ForwardItem(
        token_ids, positions, slots_of(block_table, block_size, num_cached, num_cached + n), block_table, num_cached,
        parents=None if chain else list(parents), logit_rows=list(logit_rows),
    )
