"""Which drafted tokens each decoding request verifies this step: a rooted subtree of its draft.

With the goodput planner (scheduler/planner.py) the batch's subtrees are chosen
together, node by node, while expected goodput rises; without it every drafted
node is verified, request by request, while the token budget lasts. Nodes deeper
than the tokens a request may still generate are never offered.
"""
from __future__ import annotations

from collections.abc import Callable

from drafters.base import Draft
from drafters.tree import depths, subtree
from scheduler.acceptance import AcceptanceEstimator
from scheduler.config import SchedulerConfig
from scheduler.planner import PlannedTree, expected_accepted, plan_verification
from scheduler.records import ScheduledRequest
from scheduler.request import Request


def draft_depth_limit(req: Request, max_model_len: int) -> int:
    """Draft depth worth considering: no more tokens than the request may still generate after its bonus token."""
    return max(min(req.max_new_tokens_left, max_model_len - len(req.all_token_ids)) - 1, 0)


def offered_nodes(draft: Draft | None, depth_limit: int) -> list[int]:
    """The draft's nodes within the depth limit (a rooted subtree: depth grows away from the root)."""
    if draft is None:
        return []
    return [n for n, depth in enumerate(depths(draft.parents)) if depth <= depth_limit]


class DraftSelector:
    def __init__(self, config: SchedulerConfig, estimator: AcceptanceEstimator, max_model_len: int) -> None:
        self.config = config
        self.estimator = estimator
        self.max_model_len = max_model_len

    def select(
        self, decoding: list[ScheduledRequest], num_base_tokens: int, budget: int,
        step_seconds: Callable[[int], float] | None, path_seconds: Callable[[int], float] = lambda context_len: 0.0,
        prefill_worth: float = 0.0,
    ) -> list[list[int]]:
        """Per decoding request, the nodes of its draft to verify, in the order chosen (parents first).

        path_seconds(context_len): what one more root-to-leaf path costs a request with that much context.
        prefill_worth: the tokens the step's prefill chunks count as yielding (scheduler/planner.py)."""
        offered = [offered_nodes(item.req.draft, draft_depth_limit(item.req, self.max_model_len)) for item in decoding]
        if step_seconds is None or not self.config.use_goodput_planner:
            return _first_come(offered, budget)
        trees = [
            self._planned_tree(item.req, nodes, path_seconds(item.req.num_computed_tokens))
            for item, nodes in zip(decoding, offered)
        ]
        chosen = plan_verification(trees, num_base_tokens, len(decoding) + prefill_worth, step_seconds, budget)
        return [[nodes[i] for i in picked] for nodes, picked in zip(offered, chosen)]

    def _planned_tree(self, req: Request, nodes: list[int], path_seconds: float) -> PlannedTree:
        if not nodes:
            return PlannedTree([], [])
        rates = self.estimator.estimate(req, req.draft)
        return PlannedTree(subtree(req.draft.parents, nodes), [rates[n] for n in nodes], path_seconds)

    def expected_tokens(self, req: Request, nodes: list[int]) -> float:
        """Tokens verifying NODES of the request's draft is expected to yield: the bonus token and the accepted ones."""
        if not nodes:
            return 1.0
        return 1.0 + expected_accepted(PlannedTree(req.draft.parents, self.estimator.estimate(req, req.draft)), nodes)


def attach_draft(item: ScheduledRequest, nodes: list[int]) -> None:
    """Append the selected NODES of the request's draft (any order, parents among them) to the item's tokens."""
    if not nodes:
        return
    draft, kept = item.req.draft, sorted(nodes)
    item.token_ids = item.token_ids + [draft.token_ids[n] for n in kept]
    item.draft_nodes = kept
    item.draft_parents = subtree(draft.parents, kept)


def _first_come(offered: list[list[int]], budget: int) -> list[list[int]]:
    """Without the planner: every offered node, in draft order, request by request while the budget lasts."""
    chosen = []
    for nodes in offered:
        chosen.append(nodes[:max(budget, 0)])
        budget -= len(chosen[-1])
    return chosen
