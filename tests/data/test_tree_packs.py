"""pack_tree (packing.mode: tree) on trees of token paths: literal tables of the packs it cuts (budgets after P), and
over random trees every pack checked against the tree of its own paths, counted token by token."""

import random

import pytest

from packtrain.data.prefix_tree import build_tree
from packtrain.data.tree_packs import attention_pairs, pack_tree


def counted(paths) -> tuple[int, int, int]:
    """(tokens, pairs past P's keys, leaves) of the tree of ``paths``, by hand: every distinct path prefix is one
    token, which reads as many keys after P as its length; a leaf is a distinct path that no other path extends."""
    prefixes = {tuple(p[:k]) for p in paths for k in range(1, len(p) + 1)}
    distinct = {tuple(p) for p in paths}
    leaves = [p for p in distinct if not any(len(q) > len(p) and q[:len(p)] == p for q in distinct)]
    return len(prefixes), sum(map(len, prefixes)), len(leaves)


def table(packs) -> list[tuple[tuple[int, ...], int, int, int]]:
    return [(p.paths, p.positions, p.attention_pairs, p.leaves) for p in packs]


FOUR = [(1, 2, 3, 4), (1, 2, 3, 5, 6), (1, 2, 7, 8, 9), (1, 2, 7, 8, 10, 11)]

# (name, paths, capacity after P, max leaves, expected packs as (paths, positions, pairs, leaves)); pairs by hand
# as the sum over distinct path prefixes of their lengths
PACKS = [
    # nodes "1 2", "3", "4", "5 6", "7 8", "9", "10 11": 11 tokens
    ("the whole tree fits", FOUR, 11, 90, [((0, 1, 2, 3), 11, 1 + 2 + 3 + 4 + 4 + 5 + 3 + 4 + 5 + 5 + 6, 4)]),
    # one token short: "1 2" is split, each subtree goes with its own copy of it; the larger (7 tokens) first
    ("cut below the root by the budget", FOUR, 10, 90,
     [((2, 3), 7, 1 + 2 + 3 + 4 + 5 + 5 + 6, 2), ((0, 1), 6, 1 + 2 + 3 + 4 + 4 + 5, 2)]),
    # three trees of one node each; two leaves per pack, ties by depth-first order ((5,) before (6,))
    ("max leaves", [(7,), (6,), (5,), (5,)], 100, 2, [((2, 3, 1), 2, 2, 2), ((0,), 1, 1, 1)]),
    # "1 2" ends path 2 and does not fit with both subtrees: path 2 joins the holder of "1 2" with the least room
    # (both have 1 left: the oldest)
    ("a path ending at a split node", [(1, 2, 6, 7, 8), (1, 2, 3, 4, 5), (1, 2)], 6, 90,
     [((2, 1), 5, 1 + 2 + 3 + 4 + 5, 1), ((0,), 5, 1 + 2 + 3 + 4 + 5, 1)]),
    # path 1 needs 2 tokens beside path 0 (which holds "1 2"), 4 anywhere else
    ("an item goes where its path is held", [(1, 2, 3, 4, 5, 6, 7), (9, 9, 9, 9, 9, 9), (1, 2, 8), (1, 2, 9, 9)], 9, 90,
     [((0, 3), 9, 28 + 3 + 4, 2), ((2, 1), 9, 6 + 21, 2)]),
    ("a path that is a prefix of another is no leaf", [(1, 2, 3, 4), (1, 2)], 4, 1, [((1, 0), 4, 10, 1)]),
]


@pytest.mark.parametrize("name, paths, capacity, max_leaves, expected", PACKS, ids=[t[0] for t in PACKS])
def test_pack_tables(name, paths, capacity, max_leaves, expected):
    assert table(pack_tree(build_tree(paths), capacity, max_leaves)) == expected
    assert [counted([paths[i] for i in p]) for p, *_ in expected] == [tuple(e[1:]) for e in expected]


def test_paths_with_equal_tokens_are_ordered_by_tie():
    paths = [(1, 2, 3), (1, 2, 4), (1, 2, 3), (1, 2, 3)]
    assert pack_tree(build_tree(paths), 10, 90)[0].paths == (0, 2, 3, 1)  # by index without a tie
    assert pack_tree(build_tree(paths), 10, 90, tie=lambda i: -i)[0].paths == (3, 2, 0, 1)


@pytest.mark.parametrize("seed", range(200))
def test_every_pack_is_the_tree_of_its_paths(seed):
    """Random trees (shared runs, prefixes, duplicates): every path in exactly one pack, in depth-first order of its
    tokens; a pack's tokens, pairs and leaves those of the tree of its paths, within the capacity and max leaves."""
    rng = random.Random(seed)
    bases = [tuple(rng.randrange(3) for _ in range(rng.randint(1, 10))) for _ in range(rng.randint(1, 4))]
    paths = []
    for _ in range(rng.randint(1, 16)):
        b = rng.choice(bases)
        path = b[:rng.randint(0, len(b))] + tuple(rng.randrange(3) for _ in range(rng.randint(0, 4)))
        paths.append(path or (0,))
    capacity, max_leaves = rng.randint(max(map(len, paths)), 24), rng.randint(1, 4)
    packs = pack_tree(build_tree(paths), capacity, max_leaves)
    assert sorted(i for p in packs for i in p.paths) == list(range(len(paths)))
    for p in packs:
        mine = [paths[i] for i in p.paths]
        assert (p.positions, p.attention_pairs, p.leaves) == counted(mine)
        assert p.positions <= capacity and p.leaves <= max_leaves
        assert list(p.paths) == sorted(p.paths, key=lambda i: (paths[i], i))


def test_tree_attention_pairs_by_hand():
    # P of 2; nodes "1 2" (start 0) and "3" (start 2), "4 5" (start 2)
    tree = build_tree([(1, 2, 3), (1, 2, 4, 5)])
    assert attention_pairs(2, tree) == 3 + (2 * 2 + 3) + (1 * 4 + 1) + (2 * 4 + 3)
