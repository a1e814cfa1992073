"""The attention-pair counts against a count of the visible (query, key) pairs, one by one, from the masks'
definitions."""

import itertools

import pytest

from packtrain.data.attention_pairs import causal_pairs, node_pairs, pack_pairs, tree_pairs
from packtrain.data.prefix_tree import build_tree
from packtrain.data.tree_packs import attention_pairs


def _visible_in_pack(prefix: int, conts: list[int]) -> int:
    """Rows of [P, C1, ..., Cn]: a P row sees P up to itself; a continuation row sees P and its own earlier rows."""
    segment = [-1] * prefix + [i for i, n in enumerate(conts) for _ in range(n)]
    T = len(segment)
    return sum(1 for q, k in itertools.product(range(T), repeat=2)
               if k <= q and (segment[k] == -1 or segment[k] == segment[q]))


@pytest.mark.parametrize("prefix, conts", [(0, [5]), (7, []), (4, [1, 3, 2]), (9, [6, 6, 1, 4])])
def test_a_pack_counts_what_its_mask_lets_through(prefix, conts):
    assert pack_pairs(prefix, conts) == _visible_in_pack(prefix, conts)
    assert causal_pairs(prefix + sum(conts)) == _visible_in_pack(prefix + sum(conts), [])


def test_a_tree_counts_each_token_once_reading_p_and_its_path():
    paths = [(1, 2, 3), (1, 2, 4, 5), (1, 6), (7,), (1, 2, 3, 8)]
    tree, prefix = build_tree(paths), 3
    # every distinct (path prefix) is one token; it reads P, its ancestors' tokens and itself
    tokens = {path[:i + 1] for path in paths for i in range(len(path))}
    expected = causal_pairs(prefix) + sum(prefix + len(t) for t in tokens)
    assert attention_pairs(prefix, tree) == expected
    nodes = sum(map(node_pairs, tree.start, tree.end))
    assert tree_pairs(prefix, tree.positions, nodes) == expected and tree.positions == len(tokens)
