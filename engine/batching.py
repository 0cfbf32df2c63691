"""The scheduler's decisions as forward items, and what of a forward a drafter is shown afterwards.

A scheduled request becomes one item: its uncomputed tokens as a chain, then the
selected draft nodes as a tree hanging off its last real token (row num_real - 1),
then its look-ahead chains (scheduler/lookahead.py), each a branch off that token too.
"""
from __future__ import annotations

import torch

from drafters.base import CaptureSpec, Computed
from drafters.tree import ROOT
from engine.model.forward import ForwardBatch, ForwardItem, ForwardOutput, RowChoice, tree_item
from scheduler.records import ScheduledRequest, Verification


def forward_batch(scheduled: list[ScheduledRequest], block_size: int, capture: CaptureSpec) -> ForwardBatch:
    return ForwardBatch([forward_item(item, block_size, capture) for item in scheduled], capture)


def forward_item(item: ScheduledRequest, block_size: int, capture: CaptureSpec) -> ForwardItem:
    num_real, n = item.num_real_tokens, len(item.token_ids)
    last_real = num_real - 1
    parents = list(range(-1, last_real)) + [last_real if p == ROOT else num_real + p for p in item.draft_parents]
    logit_rows = list(range(last_real, n)) if item.reaches_end else []
    token_ids, drafter_rows = list(item.token_ids), []
    for chain in item.lookahead:  # each hangs off the last real token; its last row's logits go to the drafter
        parents += [last_real] + list(range(len(token_ids), len(token_ids) + len(chain) - 1))
        token_ids += chain
        drafter_rows.append(len(token_ids) - 1)
    forward = tree_item(token_ids, parents, item.num_computed, item.block_table, block_size, logit_rows)
    forward.drafter_rows = drafter_rows
    sampling = item.req.sampling
    if sampling.greedy and not sampling.processes_logits and sampling.logprobs is None:
        forward.choice = RowChoice()  # greedy: the runner sends the rows' argmax
    if capture.hidden_layers:
        forward.hidden_rows = list(range(n))  # the look-ahead rows' are nobody's
    if capture.attention_heads:
        forward.attention_rows = logit_rows or [n - 1]  # the last committed token is one of these
    return forward


def committed_rows(item: ScheduledRequest, result: Verification) -> list[int]:
    """Rows of the item whose KV the step committed, in position order: its real tokens, then the accepted path."""
    return list(range(item.num_real_tokens)) + [item.num_real_tokens + node for node in result.accepted_nodes]


def computed_for_drafter(
    item: ScheduledRequest, forward: ForwardItem, result: Verification, output: ForwardOutput, index: int,
) -> Computed:
    """The tokens the step committed for one request, with the captures at those rows in position order."""
    rows = committed_rows(item, result)
    computed = Computed(item.num_computed, [item.token_ids[row] for row in rows])
    computed.lookahead_logits = output.drafter_logits[index]
    hidden = output.hidden[index]
    if hidden is not None:
        # hidden_rows are every row, in order: a decode step's one row needs no copy
        computed.hidden_states = hidden if len(rows) == len(hidden) else hidden[rows]
    attention = output.attention[index]
    if attention is not None:
        last = forward.attention_rows.index(rows[-1])
        key_order = list(range(forward.num_cached)) + [forward.num_cached + row for row in rows]
        computed.attention = attention[last][:, torch.tensor(key_order)]  # [heads, positions so far]
    return computed
