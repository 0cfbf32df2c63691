"""Token trees: depths, sibling ranks, subtrees, and k rows merged into one trie."""
import pytest

from drafters.base import Draft
from drafters.tree import (
    Trie,
    chain_parents,
    children,
    depths,
    is_chain,
    merge_rows,
    path_to,
    scored_walk,
    sibling_ranks,
    subtree,
)


def test_a_chain_is_the_tree_whose_every_node_follows_the_one_before():
    assert chain_parents(3) == [-1, 0, 1] and is_chain([-1, 0, 1]) and not is_chain([-1, -1])
    assert Draft([5, 6, 7], "x").parents == [-1, 0, 1]


def test_depths_ranks_and_children():
    parents = [-1, 0, 0, -1, 3, 1]
    assert depths(parents) == [1, 2, 2, 1, 2, 3]
    assert sibling_ranks(parents) == [0, 0, 1, 1, 0, 0]
    assert children(parents) == {-1: [0, 3], 0: [1, 2], 3: [4], 1: [5]}
    assert path_to(parents, 5) == [0, 1, 5]


def test_a_subtree_is_reindexed_in_list_order():
    assert subtree([-1, 0, 0, -1, 3, 1], [5, 0, 1, 3]) == [-1, 0, -1, 1]


def test_merging_rows_shares_their_common_prefixes_and_keeps_row_order():
    tokens, parents, paths = merge_rows([[1, 2, 3], [1, 2, 4], [5], [1, 6]])
    assert tokens == [1, 2, 3, 4, 5, 6] and parents == [-1, 0, 1, 1, -1, 0]
    assert paths == [[0, 1, 2], [0, 1, 3], [4], [0, 5]]
    assert sibling_ranks(parents)[tokens.index(4)] == 1  # the second row's last token is its parent's second child


def test_a_trie_grows_only_where_a_row_leaves_it():
    trie = Trie()
    assert trie.add([1, 2, 3]) == ([0, 1, 2], True)
    assert trie.add([1, 2]) == ([0, 1], False)  # a prefix of a row added: nothing new
    assert trie.add([1, 4]) == ([0, 3], True)
    assert (trie.token_ids, trie.parents) == ([1, 2, 3, 4], [-1, 0, 1, 0])


def test_a_draft_rejects_a_parent_listed_after_its_child():
    with pytest.raises(ValueError):
        Draft([1, 2], "x", [1, -1])


def test_the_scored_walk_scores_every_child_of_the_targets_path_and_stops_where_it_leaves_the_tree():
    token_ids, parents, _ = merge_rows([[5, 6, 7], [5, 8], [9]])  # 5 -> 6 -> 7, 5 -> 8, 9
    assert scored_walk(token_ids, parents, [5, 8, 1]) == [(0, 1, True), (4, 1, False), (1, 2, False), (3, 2, True)]
    assert scored_walk(token_ids, parents, [9, 4]) == [(0, 1, False), (4, 1, True)]  # a leaf: nothing below
    assert scored_walk(token_ids, parents, [2]) == [(0, 1, False), (4, 1, False)]
    assert scored_walk([], [], [3]) == []
