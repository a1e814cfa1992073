"""packtrain/data/prefix_tree.py's parts on their own: the ``bytes`` keys, the two helpers of the build (``_common``: where
two sorted keys part; ``_bounds``: where a path's nodes end) against brute force, the columns no other test reads
directly (``stop``, ``source``, ``by_last``), ``node_at``, the refusal of token ids past 32 bits, and the salts that
keep images and preference pairs apart. The trees themselves as tables and against a per-token trie:
tests/data/test_tree_planner.py."""

import itertools
import random

import pytest

from packtrain.data.example import Example
from packtrain.data.images import ImageRef
from packtrain.data.prefix_tree import (
    _TAIL,
    _WIDTH,
    _bounds,
    _common,
    build_tree,
    continuations,
    example_keys,
    example_tree,
    image_salt,
    key_tokens,
    path_key,
    tree_salt,
)

# token ids around the byte boundaries of a key
WIDE = [0, 1, 255, 256, 257, 65535, 65536, 2**24 - 1, 2**24, 2**31, 2**32 - 1]


def random_paths(rng: random.Random, alphabet=(0, 1, 2), empty: bool = True) -> list[tuple[int, ...]]:
    base = [tuple(rng.choice(alphabet) for _ in range(rng.randint(0, 9))) for _ in range(rng.randint(1, 4))]
    paths = []
    for _ in range(rng.randint(1, 14)):  # prefixes of a few bases, extended: shared runs, prefixes, duplicates
        b = rng.choice(base)
        path = b[:rng.randint(0, len(b))] + tuple(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
        paths.append(path if path or empty else (alphabet[0],))
    return paths


# --- keys ---------------------------------------------------------------------------------------------------------

KEYS = [((), (), b""), ((1,), (), b"\0\0\0\x01"), ((0x01020304, 255), (), bytes([1, 2, 3, 4, 0, 0, 0, 255])),
        ((7,), (2**32 - 1,), b"\0\0\0\x07\xff\xff\xff\xff"), ((), (256,), b"\0\0\x01\0")]


@pytest.mark.parametrize("tokens, more, key", KEYS)
def test_a_key_is_its_tokens_big_endian_in_4_bytes(tokens, more, key):
    assert path_key(tokens, more) == key
    assert key_tokens(key) == len(tokens) + len(more)


@pytest.mark.parametrize("seed", range(20))
def test_keys_compare_as_the_token_tuples_do(seed):
    rng = random.Random(seed)
    paths = random_paths(rng, alphabet=rng.sample(WIDE, 4))
    for a in paths:
        for b in paths:
            assert (path_key(a) < path_key(b)) == (a < b) and (path_key(a) == path_key(b)) == (a == b), (a, b)
        cut = rng.randint(0, len(a))
        assert path_key(a[:cut], a[cut:]) == path_key(a)  # an item, then its target: one path


@pytest.mark.parametrize("bad", [2**32, 2**40, -1])
def test_token_ids_past_32_bits_are_refused_as_a_user_error(bad):
    with pytest.raises(ValueError, match=r"a prefix tree takes token ids in \[0, 2\*\*32\)"):
        build_tree([(1, 2), (1, bad)])
    examples = [Example("e0", (9,), (1,), (2, bad))]
    with pytest.raises(ValueError, match=r"a prefix tree takes token ids in \[0, 2\*\*32\)"):
        example_keys(examples)


def test_the_extreme_token_ids_are_taken():
    tree = build_tree([(0, 2**32 - 1), (0, 0)])
    assert [n.tokens for n in tree.nodes] == [(0,), (0,), (2**32 - 1,)]


# --- where two sorted keys part, and where a path's nodes end ------------------------------------------------------

COMMON = [((1, 2), (1, 3), 1), ((5,), (6,), 0), ((1, 0x100), (1, 0x200), 1), ((1, 2, 3), (1, 2, 2**31), 2),
          ((0, 2**32 - 2), (0, 2**32 - 1), 1), ((1, 9, 9, 9), (2,), 0)]


@pytest.mark.parametrize("a, b, common", COMMON)
def test_common_table(a, b, common):
    assert _common(path_key(a), path_key(b)) == common


def test_common_equals_brute_force_on_either_side_of_its_tail():
    """Keys parting anywhere in paths shorter and longer than the tail it compares at once (64 tokens), at any byte
    of the token where they part; the later key shorter, as long or longer."""
    rng = random.Random(0)
    tail = _TAIL // _WIDTH
    for length in (1, 2, tail - 1, tail, tail + 1, 2 * tail + 3, 5 * tail):
        a = tuple(rng.randrange(2**32) for _ in range(length))
        for at in sorted({0, length - 1, *(rng.randrange(length) for _ in range(40)), *range(max(0, length - 70),
                                                                                             length)}):
            changed = a[at] ^ (1 << rng.randrange(32))
            b = a[:at] + (changed,) + tuple(rng.randrange(2**32) for _ in range(rng.choice([0, 1, length])))
            lo, hi = sorted([a, b])
            assert _common(path_key(lo), path_key(hi)) == at, (length, at)


def reference_bounds(lcp: list[int], lengths: list[int]) -> list[list[int]]:
    """Per k: its own end, then the distinct running minima of lcp[k + 1:] above lcp[k] and below its end, largest
    first."""
    out = []
    for k in range(len(lcp)):
        minima = {min(lcp[k + 1:j + 1]) for j in range(k + 1, len(lcp))}
        out.append([lengths[k], *sorted((m for m in minima if lcp[k] < m < lengths[k]), reverse=True)])
    return out


def test_bounds_table():
    # sorted paths (1, 2), (1, 2, 3), (1, 4): the first makes (1,) and (2,), the second (3,), the third (4,)
    assert _bounds([0, 2, 1], [2, 3, 2]) == [[2, 1], [3], [2]]
    # a chain of turns, each a prefix of the next: one node each
    assert _bounds([0, 2, 4], [2, 4, 6]) == [[2], [4], [6]]
    assert _bounds([], []) == []


@pytest.mark.parametrize("seed", range(60))
def test_bounds_equal_brute_force_over_sorted_paths(seed):
    rng = random.Random(seed)
    paths = sorted(random_paths(rng))
    lcp = [0, *(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in itertools.pairwise(paths))]
    assert _bounds(lcp, [len(p) for p in paths]) == reference_bounds(lcp, [len(p) for p in paths])


# --- the columns ----------------------------------------------------------------------------------------------------


def test_columns_by_hand():
    # nodes in depth-first order: 0 (1,) -> 1 (2, 3) -> {2 (4,), 3 (5,)}; 0 -> 4 (6,); 5 (7, 7)
    paths = [(7, 7), (1, 2, 3, 5), (1, 6), (1, 2, 3, 4), (1, 2, 3, 4), (1,)]
    tree = build_tree(paths)
    assert [n.tokens for n in tree.nodes] == [(1,), (2, 3), (4,), (5,), (6,), (7, 7)]
    assert (tree.parent, tree.start, tree.end) == ([-1, 0, 1, 1, 0, -1], [0, 1, 3, 3, 1, 0], [1, 3, 4, 4, 2, 2])
    assert tree.stop == [5, 4, 3, 4, 5, 6]  # a subtree is the run [i, stop[i])
    assert tree.last == [5, 3, 4, 2, 2, 0]
    assert tree.by_last == [5, 3, 4, 1, 2, 0]  # by last node, equal ones (3 and 4) by index
    assert tree.positions == 8
    assert [tree.ancestors(n) for n in range(6)] == [[], [0], [0, 1], [0, 1], [0], []]


@pytest.mark.parametrize("seed", range(100))
def test_columns_over_random_paths(seed):
    rng = random.Random(seed)
    salted = seed % 2 == 1
    paths = random_paths(rng, empty=not salted)
    salts = [rng.choice([(), ("x",)]) for _ in paths] if salted else None
    tree = build_tree(paths, salts)
    n = len(tree.parent)
    assert n <= 2 * len(paths)
    for i in range(n):
        below = [j for j in range(n) if i in tree.ancestors(j)]
        assert below == list(range(i + 1, tree.stop[i]))  # its subtree: the nodes right after it
        assert i in tree.paths[tree.source[i]]  # the path it was made from runs through it
    for j, path in enumerate(paths):
        assert tree.last[j] == (tree.paths[j][-1] if path else -1)
        if path:
            assert tree.end[tree.last[j]] == len(path)  # its last node ends where it does
    assert sorted(tree.by_last) == list(range(len(paths)))
    ranked = [(tree.last[j], j) for j in tree.by_last]
    assert ranked == sorted(ranked)  # the paths by last node, ties by index


def test_node_at_each_position_and_past_the_end():
    tree = build_tree([(1, 2, 3), (1, 2, 4, 5), ()])  # nodes 0 (1, 2), 1 (3,), 2 (4, 5)
    assert [tree.node_at(1, p) for p in range(4)] == [0, 0, 2, 2]
    assert [tree.node_at(0, p) for p in range(3)] == [0, 0, 1]
    with pytest.raises(IndexError, match="position 4 is past the end of path 1"):
        tree.node_at(1, 4)
    with pytest.raises(IndexError, match="position 0 is past the end of path 2"):
        tree.node_at(2, 0)


# --- examples and their salts ---------------------------------------------------------------------------------------


def _ex(i, item, target, **kw):
    return Example(f"e{i}", (100, 101), tuple(item), tuple(target), **kw)


def test_salts_of_text_images_and_pairs():
    text = _ex(0, (1,), (2,))
    pictured = _ex(1, (1,), (2,), images=(ImageRef("a.png", (1, 2, 2)), ImageRef("b.png", (1, 4, 4))))
    chosen = _ex(2, (1,), (2,), pair="p7", side="chosen")
    assert image_salt(text) == tree_salt(text) == ()
    assert image_salt(pictured) == tree_salt(pictured) == (("a.png", (1, 2, 2)), ("b.png", (1, 4, 4)))
    assert image_salt(chosen) == () and tree_salt(chosen) == (("pair", "p7"),)
    assert image_salt(object()) == tree_salt(object()) == ()  # anything without images or a pair


def test_text_examples_are_sorted_without_salts():
    examples = [_ex(0, (1, 2), (3,)), _ex(1, (1,), (2, 4))]
    keys, salts = example_keys(examples)
    assert keys == [path_key((1, 2, 3)), path_key((1, 2, 4))] and salts is None
    assert [continuations(examples)(j) for j in range(2)] == [(1, 2, 3), (1, 2, 4)]
    assert [n.tokens for n in example_tree(examples).nodes] == [(1, 2), (3,), (4,)]


def test_a_pair_is_a_subtree_of_its_own_after_the_text():
    examples = [_ex(0, (1, 2), (3,)), _ex(1, (1, 2), (3,), pair="p", side="chosen"),
                _ex(2, (1, 2), (4,), pair="p", side="rejected"), _ex(3, (5,), (6,))]
    _, salts = example_keys(examples)
    assert salts == [(), (("pair", "p"),), (("pair", "p"),), ()]
    tree = example_tree(examples)
    # salt () first, every text path by its tokens; then the pair: its item -> {chosen, rejected}
    assert [(n.tokens, n.parent) for n in tree.nodes] == [((1, 2, 3), -1), ((5, 6), -1), ((1, 2), -1), ((3,), 2),
                                                          ((4,), 2)]
    assert tree.paths == [[0], [2, 3], [2, 4], [1]]


def test_images_share_nothing_with_text_or_other_images():
    a, b = (ImageRef("a.png", (1, 2, 2)),), (ImageRef("a.png", (1, 4, 4)),)  # one file, another grid
    examples = [_ex(0, (1, 2), (3,), images=a), _ex(1, (1, 2), (3,)), _ex(2, (1, 2), (4,), images=a),
                _ex(3, (1, 2), (3,), images=b)]
    _, salts = example_keys(examples)
    assert salts == [image_salt(ex) for ex in examples]
    tree = example_tree(examples)
    assert [(n.tokens, n.parent) for n in tree.nodes] == [((1, 2, 3), -1), ((1, 2), -1), ((3,), 1), ((4,), 1),
                                                          ((1, 2, 3), -1)]
    assert tree.paths == [[1, 2], [0], [1, 3], [4]]
