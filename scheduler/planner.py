"""Goodput planner: which drafted tokens to verify (Speculative Verification, §5, applied to tree nodes).

A draft is a tree (drafters/tree.py). With a_n the conditional acceptance of node n (given its parent is accepted),
the node lies on the accepted path with probability P(n) = a_n * P(parent), and verifying a rooted subtree S yields
sum_{n in S} P(n) accepted tokens in expectation beyond the one token every request gets: at most one child of a node
is accepted, so the events add up. Over a batch, the planner starts from the tokens every request must process (its
prefill chunk, or its last token), then adds drafted nodes one at a time, always the one (from any request, among the
children of the root and of nodes already chosen) with the largest P(n), and keeps the prefix of that order whose
goodput (expected tokens per second of forward latency) is highest. SV stops at the first decline, assuming goodput is
concave; taking the best prefix gives the same answer then and stays right when a noisy latency profile is not
concave. A chain is the tree whose every node has one child. A node whose parent already has a chosen child opens a
new root-to-leaf path, which costs its request `path_seconds` on top of the token count's latency (each path reads the
request's context again: scheduler/latency.py); trees are priced by their paths.

A prefill chunk in the step yields no token now, but it is work the server must do: counted as worth nothing, its
seconds lower the step's goodput so far that rows of a fraction of the acceptance that pays in a decode step look
worth verifying beside it, and each costs the chunk's requests (and every other) its seconds all the same. So the
chunks count as the tokens their seconds would yield spent decoding at the batch's plain rate (`prefill_worth`):
a row verified beside a chunk must then pay as it would in a step without it.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from drafters.tree import ROOT, children


@dataclass(frozen=True)
class PlannedTree:
    """What the planner sees of one request's draft."""

    parents: list[int]  # [n] parent of each node, -1 = the request's last token
    acceptance: list[float]  # [n] conditional acceptance estimate of each node
    path_seconds: float = 0.0  # what one more root-to-leaf path of this request's tree costs


def path_probabilities(tree: PlannedTree) -> list[float]:
    """[n] probability that each node lies on the accepted path."""
    result: list[float] = []
    for parent, rate in zip(tree.parents, tree.acceptance):
        result.append(rate * (1.0 if parent == ROOT else result[parent]))
    return result


def expected_accepted(tree: PlannedTree, nodes: list[int]) -> float:
    """Accepted draft tokens expected when NODES (a rooted subtree) are verified."""
    paths = path_probabilities(tree)
    return sum(paths[n] for n in nodes)


def prefill_worth(num_tokens: int, num_decoding: int, latency: Callable[[int], float]) -> float:
    """Tokens a step's prefill chunks count as yielding: the seconds they add to the NUM_DECODING requests' plain
    decode step (NUM_TOKENS in all), at the tokens per second of that plain step (one token per request)."""
    if not num_decoding or num_tokens <= num_decoding:
        return 0.0
    plain = latency(num_decoding)
    return num_decoding / plain * (latency(num_tokens) - plain)


def plan_verification(
    trees: list[PlannedTree],
    num_base_tokens: int,
    num_base_expected: float,
    latency: Callable[[int], float],
    max_draft_tokens: int | None = None,
) -> list[list[int]]:
    """Per request, the nodes of its draft to verify, in the order chosen (a parent before its children).

    num_base_tokens: tokens in the forward before any draft (prefill chunks + one per decoding request).
    num_base_expected: tokens the batch yields without drafts (one per decoding request), and what its prefill chunks
        count as yielding (prefill_worth).
    latency: seconds of a forward over n tokens.
    max_draft_tokens: drafted tokens the step's token budget leaves room for (None: no bound).
    """
    order = greedy_order(trees)[:max_draft_tokens]
    best_len, best_goodput = 0, num_base_expected / latency(num_base_tokens)
    expected, path_seconds = num_base_expected, 0.0
    has_child = [set() for _ in trees]  # per request, the nodes (ROOT included) with a chosen child
    for length, (gain, request, node) in enumerate(order, start=1):
        expected += gain
        parent = trees[request].parents[node]
        if parent in has_child[request]:
            path_seconds += trees[request].path_seconds
        has_child[request].add(parent)
        goodput = expected / (latency(num_base_tokens + length) + path_seconds)
        if goodput > best_goodput * (1 + 1e-9):
            best_len, best_goodput = length, goodput
    chosen: list[list[int]] = [[] for _ in trees]
    for _, request, node in order[:best_len]:
        chosen[request].append(node)
    return chosen


def greedy_order(trees: list[PlannedTree]) -> list[tuple[float, int, int]]:
    """Every drafted node as (path probability, request, node), largest first; a node comes after its parent."""
    kids = [children(tree.parents) for tree in trees]
    heap = [(-tree.acceptance[n], r, n) for r, tree in enumerate(trees) for n in kids[r].get(ROOT, ())]
    heapq.heapify(heap)
    order = []
    while heap:
        negative_gain, request, node = heapq.heappop(heap)
        order.append((-negative_gain, request, node))
        tree = trees[request]
        for child in kids[request].get(node, ()):
            heapq.heappush(heap, (negative_gain * tree.acceptance[child], request, child))
    return order


def num_extra_paths(parents: list[int]) -> int:
    """Root-to-leaf paths beyond the first of a tree (0 for a chain or no draft)."""
    if not parents:
        return 0
    has_child = set(parents)
    return sum(1 for node in range(len(parents)) if node not in has_child) - 1
