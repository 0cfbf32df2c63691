"""Token trees: a draft as a list of tokens with a parent index per token.

A tree lists its nodes parents first (`parents[i] < i`); parent -1 is the root, the
request's last token, which the target computes along with the tree. A chain of n
tokens is the tree `[-1, 0, 1, ..., n - 2]`. The children of a node keep list order:
a node's sibling rank is the number of its siblings listed before it.
"""
from __future__ import annotations

from typing import Sequence

ROOT = -1


def chain_parents(num_tokens: int) -> list[int]:
    return list(range(-1, num_tokens - 1))


def is_chain(parents: Sequence[int]) -> bool:
    return all(parent == i - 1 for i, parent in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """[n] depth of each node: 1 for a child of the root."""
    result: list[int] = []
    for parent in parents:
        result.append(1 if parent == ROOT else result[parent] + 1)
    return result


def sibling_ranks(parents: Sequence[int]) -> list[int]:
    """[n] how many earlier nodes share each node's parent."""
    seen: dict[int, int] = {}
    ranks = []
    for parent in parents:
        ranks.append(seen.get(parent, 0))
        seen[parent] = ranks[-1] + 1
    return ranks


def children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Parent index (ROOT for the root) -> its children in list order."""
    result: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        result.setdefault(parent, []).append(node)
    return result


def subtree(parents: Sequence[int], nodes: Sequence[int]) -> list[int]:
    """The parents of the rooted subtree made of NODES (each node's parent among them), re-indexed in list order."""
    kept = sorted(nodes)
    new_index = {old: new for new, old in enumerate(kept)}
    return [ROOT if parents[old] == ROOT else new_index[parents[old]] for old in kept]


def merge_rows(rows: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """k candidate continuations merged into one tree (a trie): shared prefixes become shared nodes.

    Returns (token_ids, parents, paths), paths[r] being the nodes of row r. Nodes follow the
    rows' order, so the first row's tokens are every node's first child: verifying the tree
    accepts the same tokens as verifying the k rows one by one and keeping the longest match.
    """
    token_ids: list[int] = []
    parents: list[int] = []
    paths: list[list[int]] = []
    child_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for row in rows:
        node, path = ROOT, []
        for token in row:
            key = (node, token)
            if key not in child_of:
                child_of[key] = len(token_ids)
                token_ids.append(token)
                parents.append(node)
            node = child_of[key]
            path.append(node)
        paths.append(path)
    return token_ids, parents, paths


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to NODE."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def scored_walk(token_ids: Sequence[int], parents: Sequence[int],
                target_token_ids: Sequence[int]) -> list[tuple[int, int, bool]]:
    """(node, depth, whether its token is the target's at that depth) for every node whose parent lies on the
    target's path (the root's children always): the walk follows the matching node down while target tokens last.
    What a drafter's acceptance statistics learn from, verified or not."""
    kids = children(parents)
    scored, node = [], ROOT
    for depth, target in enumerate(target_token_ids, start=1):
        matched = None
        for child in kids.get(node, ()):
            hit = token_ids[child] == target
            scored.append((child, depth, hit))
            matched = child if hit else matched
        if matched is None:
            break
        node = matched
    return scored
