"""After verification: append each request's accepted tokens, move the accepted branch's KV into place, roll back
the rest, stop requests that are done, and count what speculation did.

A draft tree's nodes were computed at KV indices in list order after the request's
last token, whatever their depth; the accepted path's d-th node belongs at KV index
num_computed + d. Its KV is moved there (the engine copies the slots) unless it is
already in place, as it always is for a chain.
"""
from __future__ import annotations

from collections.abc import Callable

from drafters.tree import depths, sibling_ranks
from scheduler.acceptance import CalibratedEstimator
from scheduler.kv_blocks import KVBlockManager
from scheduler.records import DraftStepStats, RequestUpdate, ScheduledRequest, Verification
from scheduler.request import Request


class RequestUpdater:
    def __init__(
        self, max_model_len: int, eos_token_ids: list[int], blocks: KVBlockManager, estimator: CalibratedEstimator,
        finish: Callable[[Request, str], None],
    ) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.blocks = blocks
        self.estimator = estimator
        self.finish = finish  # ends a request: frees its blocks, lets its session keep what it should

    def update(self, item: ScheduledRequest, result: Verification) -> tuple[RequestUpdate, list[tuple[int, int]]]:
        """Apply one verification to a request that reached its end this step; returns its update and KV moves."""
        req = item.req
        self._record_speculation(item, result)
        moves = kv_moves(item, result.accepted_nodes, self.blocks.block_size)
        new_token_ids, stop_reason = self._append_until_stop(req, result.token_ids)
        req.num_computed_tokens = len(req.all_token_ids) - 1  # the last token and the accepted drafts are in the cache
        req.draft = None
        if stop_reason:
            self.finish(req, stop_reason)
        else:
            self.blocks.shrink(req.request_id, req.num_computed_tokens + 1)  # rejected drafts' KV goes back
        update = RequestUpdate(
            request_id=req.request_id,
            new_token_ids=new_token_ids,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            spec=req.spec,  # running totals, so a request closed early still reports them
            num_cached_tokens=req.num_cached_tokens,
        )
        return update, moves

    def _record_speculation(self, item: ScheduledRequest, result: Verification) -> None:
        req, draft = item.req, item.req.draft
        if item.draft_nodes:
            self.estimator.observe_verified(req, draft, item.draft_nodes, item.draft_parents, result.accepted_nodes)
        if draft is not None:  # verified or not, the draft is scored against what the target produced
            self.estimator.observe(req, draft, result.token_ids)
        if item.num_draft_tokens == 0:
            return
        spec = item.req.spec
        spec.num_drafts += 1
        spec.num_draft_tokens += item.num_draft_tokens
        spec.num_accepted_tokens += len(result.accepted_nodes)

    def _append_until_stop(self, req: Request, token_ids: list[int]) -> tuple[list[int], str | None]:
        """Append tokens up to and including the first that stops the request; returns them and the stop reason."""
        appended = []
        for token_id in token_ids:
            req.all_token_ids.append(token_id)
            appended.append(token_id)
            reason = self._stop_reason(req, token_id)
            if reason:
                return appended, reason
        return appended, None

    def _stop_reason(self, req: Request, token_id: int) -> str | None:
        if token_id in self.eos_token_ids and not req.sampling.ignore_eos:
            return "stop"
        if token_id in req.sampling.stop_token_ids:
            return "stop"
        if req.num_output_tokens >= req.sampling.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return "length"
        return None


def kv_moves(item: ScheduledRequest, accepted_nodes: list[int], block_size: int) -> list[tuple[int, int]]:
    """(from slot, to slot) pairs that put the accepted path's KV at its final positions.

    Safe in order: the d-th accepted node sits at or after KV index d, so no move overwrites a later one's source.
    """
    table, base = item.block_table, item.num_computed + item.num_real_tokens  # KV index of the first draft node
    moves = []
    for depth, node in enumerate(accepted_nodes, start=1):
        if node + 1 != depth:
            moves.append((_slot(table, block_size, base + node), _slot(table, block_size, base + depth - 1)))
    return moves


def _slot(table: list[int], block_size: int, kv_index: int) -> int:
    return table[kv_index // block_size] * block_size + kv_index % block_size


def spec_step_stats(scheduled: list[ScheduledRequest], results: list[Verification]) -> dict[str, DraftStepStats]:
    """Per drafter: how many drafted tokens were verified and accepted this step, at which depths and sibling ranks."""
    by_drafter: dict[str, DraftStepStats] = {}
    for item, result in zip(scheduled, results):
        if item.num_draft_tokens == 0:
            continue
        stats = by_drafter.setdefault(item.req.draft.source, DraftStepStats())
        stats.num_drafts += 1
        stats.num_draft_tokens += item.num_draft_tokens
        stats.num_accepted_tokens += len(result.accepted_nodes)
        ranks = sibling_ranks(item.req.draft.parents)
        _count(stats.num_accepted_per_position, range(len(result.accepted_nodes)), max(depths(item.draft_parents)))
        verified_ranks = [ranks[n] for n in item.draft_nodes]
        _count(stats.num_accepted_per_rank, [verified_ranks[n] for n in result.accepted_nodes], max(verified_ranks) + 1)
    return by_drafter


def _count(counts: list[int], indices, size: int) -> None:
    """Grow COUNTS to SIZE (every verified depth or rank appears, accepted or not) and add one at each index."""
    counts.extend([0] * (size - len(counts)))
    for i in indices:
        counts[i] += 1
