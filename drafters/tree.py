"""Token trees: a draft as a list of tokens with a parent index per token.

A tree lists its nodes parents first (`parents[i] < i`); parent -1 is the root, the
request's last token, which the target computes along with the tree. A chain of n
tokens is the tree `[-1, 0, 1, ..., n - 2]`. The children of a node keep list order:
a node's sibling rank is the number of its siblings listed before it.
"""
from __future__ import annotations

from dataclasses import dataclass
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


class Trie:
    """A token tree grown row by row: shared prefixes become shared nodes, nodes listed in the order they join."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.parents: list[int] = []
        self._child_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node

    def add(self, row: Sequence[int]) -> tuple[list[int], bool]:
        """ROW's nodes, and whether it added any (none: the tree held it already, as a prefix of an earlier row)."""
        node, path, grew = ROOT, [], False
        for token in row:
            child = self._child_of.get((node, token))
            if child is None:
                child = self._child_of[(node, token)] = len(self.token_ids)
                self.token_ids.append(token)
                self.parents.append(node)
                grew = True
            node = child
            path.append(node)
        return path, grew


def merge_rows(rows: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """k candidate continuations merged into one tree (a trie): shared prefixes become shared nodes.

    Returns (token_ids, parents, paths), paths[r] being the nodes of row r. Nodes follow the
    rows' order, so the first row's tokens are every node's first child: verifying the tree
    accepts the same tokens as verifying the k rows one by one and keeping the longest match.
    """
    trie = Trie()
    paths = [trie.add(row)[0] for row in rows]
    return trie.token_ids, trie.parents, paths


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


@dataclass
class TreeRows:
    """Where a span of tree nodes lies: each row's rotary position, the table position its KV is written at, and the
    table positions it sees besides the CONTEXT real tokens before them (its ancestors' and its own)."""

    positions: list[int]
    write_at: list[int]
    context: int
    sees: list[list[int]]
