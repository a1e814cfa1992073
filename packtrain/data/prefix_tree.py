"""The prefix tree of a prompt group's continuations (``packing.mode: tree``), pure Python.

Every example is a path from the root (P) through its continuation's tokens (item + target). Continuations that
start with the same tokens share them: the tree keeps each shared run once, as one *node* (a radix tree: a node
ends where two paths part, or where a path ends). A node's tokens are positions ``[start, start + length)`` of
every path through it, counted after P. Packs of a tree (:func:`packtrain.data.tree_packs.pack_tree`) are sets of
its subtrees.

Built from the paths sorted by their tokens, so the tree, its node order and everything derived from it depend on
the examples' tokens only, never on their input order. Nodes are numbered in depth-first order (a parent before
its children, children by their first token): the order a tree pack lays them out in one buffer.

Speed: the planner builds trees over millions of paths, each of hundreds of tokens that mostly repeat another
path's. So a path is compared as one ``bytes`` key (its tokens big-endian, 4 bytes each: the bytes compare, in C,
as the token tuples do) and the tree is columns of ints; ``Tree.nodes`` (with each node's tokens) is made only when
read. Figures: docs/performance.md, "Tree planner: 1,000,000 multi-turn examples".

Shapes: a tree of n paths of total length L has at most 2n nodes; building it is O(L log n) (the sort).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

_WIDTH = 4  # bytes per token in a key
_TYPECODE = next(code for code in "IL" if array(code).itemsize == _WIDTH)


@dataclass(slots=True)
class Node:
    parent: int  # -1: a child of P (the root)
    start: int  # the position of its first token in every path through it, counted after P
    tokens: tuple[int, ...]
    children: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class Tree:
    """Columns per node, in depth-first order, and per path (in the input order)."""

    parent: list[int]  # -1: a child of P
    start: list[int]  # positions [start, end) of every path through the node, counted after P
    end: list[int]
    stop: list[int]  # one past the node's subtree: a subtree is the run of nodes [i, stop[i])
    source: list[int]  # a path through the node (whose tokens [start, end) are the node's)
    last: list[int]  # per path: the last node it runs through, -1 for an empty path
    by_last: list[int]  # the paths by their last node in depth-first order, ties by index
    path_tokens: Callable[[int], Sequence[int]]  # a path's tokens, for Node.tokens

    @cached_property
    def nodes(self) -> list[Node]:
        nodes = [Node(parent, start, tuple(self.path_tokens(j)[start:end]))
                 for parent, start, end, j in zip(self.parent, self.start, self.end, self.source)]
        for i, node in enumerate(nodes):
            if node.parent >= 0:
                nodes[node.parent].children.append(i)
        return nodes

    @cached_property
    def paths(self) -> list[list[int]]:
        """Per path, the nodes it runs through, root side first."""
        return [[*self.ancestors(n), n] if n >= 0 else [] for n in self.last]

    @property
    def positions(self) -> int:
        """The tokens of every node: what a tree pack computes after P."""
        return sum(self.end) - sum(self.start)

    def ancestors(self, node: int) -> list[int]:
        """``node``'s ancestors, root side first (``node`` not included)."""
        out = []
        while self.parent[node] >= 0:
            node = self.parent[node]
            out.append(node)
        return out[::-1]

    def node_at(self, path: int, position: int) -> int:
        """The node holding position ``position`` (counted after P) of path ``path``."""
        for n in self.paths[path]:
            if self.start[n] <= position < self.end[n]:
                return n
        raise IndexError(f"position {position} is past the end of path {path}")


def path_key(tokens: Sequence[int], more: Sequence[int] = ()) -> bytes:
    """A path's tokens (``tokens`` then ``more``: an item, then its target) as one ``bytes`` key: each token
    big-endian in 4 bytes, so keys compare (memcmp) as the token tuples do, the shorter of two first where one is a
    prefix of the other. Token ids in [0, 2**32)."""
    key = array(_TYPECODE, tokens)
    if more:
        key += array(_TYPECODE, more)
    if _LITTLE_ENDIAN:
        key.byteswap()
    return key.tobytes()


_LITTLE_ENDIAN = sys.byteorder == "little"


def key_tokens(key: bytes) -> int:
    """The tokens of a path_key."""
    return len(key) // _WIDTH


def _keys(*pieces: Sequence[Sequence[int]]) -> list[bytes]:
    try:
        return list(map(path_key, *pieces))
    except OverflowError as e:
        raise ValueError(f"a prefix tree takes token ids in [0, 2**32): {e}") from None


def build_tree(paths: Sequence[Sequence[int]], salts: Sequence | None = None) -> Tree:
    """The radix tree of ``paths`` (token sequences after P; duplicates and paths that are
    prefixes of others allowed; an empty path runs through no node). Paths with different ``salts`` (any orderable
    values, e.g. the images an example's tokens stand for) share no node: equal tokens are not equal inputs there."""
    return tree_of_keys(_keys(paths), salts, paths.__getitem__)


def tree_of_keys(keys: list[bytes], salts: Sequence | None, path_tokens: Callable[[int], Sequence[int]]) -> Tree:
    """build_tree from the paths' keys (``path_key``); ``path_tokens(j)``: path j's tokens (read only for Tree.nodes).

    The paths in sorted order (salt, then key), with the tokens each has in common with the one before it (the
    *lcp*). In that order a depth-first walk meets each path's nodes past its lcp for the first time, so nodes are
    made in depth-first order, never split: a path's nodes past its lcp end where a later path parts from it (the
    running minima of the later lcps, found with one stack from the right) and at its own end."""
    if salts is None:
        order = sorted(range(len(keys)), key=keys.__getitem__)
    else:
        order = sorted(range(len(keys)), key=lambda i: (salts[i], keys[i]))
    ordered = list(map(keys.__getitem__, order))
    chains = map(bytes.startswith, ordered[1:], ordered)  # a path a prefix of the next one: the next turn
    lcp = [0, *(len(a) // _WIDTH if chain else _common(a, b) for a, b, chain in zip(ordered, ordered[1:], chains))]
    if salts is not None:  # the first path of each salt shares nothing with the one before it
        lcp = [c if k == 0 or salts[order[k - 1]] == salts[order[k]] else 0 for k, c in enumerate(lcp)]
    made: list[tuple[int, int, int, int]] = []  # per node: parent, start, end, the path that made it
    stop = [0] * (2 * len(keys))
    last = [-1] * len(keys)
    stack = [-1]  # the previous path's nodes, root side first, under the root (P: -1, ending at 0)
    ends = [0]  # their ends
    for i, at, bounds in zip(order, lcp, _bounds(lcp, [len(key) // _WIDTH for key in ordered])):
        while ends[-1] > at:
            stop[stack.pop()] = len(made)
            ends.pop()
        for to in reversed(bounds):
            if to > at:
                made.append((stack[-1], at, to, i))
                stack.append(len(made) - 1)
                ends.append(to)
                at = to
        last[i] = stack[-1]
    for node in stack[1:]:
        stop[node] = len(made)
    parent, start, end, source = (list(column) for column in zip(*made)) if made else ([], [], [], [])
    # sorted paths reach their last nodes in depth-first order (a path makes nodes or repeats the one before it)
    return Tree(parent, start, end, stop[:len(made)], source, last, order, path_tokens)


def _common(a: bytes, b: bytes) -> int:
    """The tokens key ``b`` starts with in common with key ``a``, where ``a < b`` and ``a`` is no prefix of ``b``.
    Neighbours in sorted order mostly part shortly before ``a`` ends (``a`` a turn whose piece the next turns'
    history drops, e.g. its reasoning: one compare, memcmp) or early (another conversation: a short bisection);
    then the bytes in doubt, as two integers, give the first byte that differs."""
    lo, hi = 0, min(len(a), len(b))  # in bytes: a[:lo] == b[:lo], a[:hi] != b[:hi] (a is no prefix of b)
    if hi > _TAIL:
        if b.startswith(a[:hi - _TAIL]):
            lo = hi - _TAIL
        else:
            hi -= _TAIL
    while hi - lo > _TAIL:
        mid = (lo + hi) // 2
        if b.startswith(a[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    differ = int.from_bytes(a[lo:hi], "big") ^ int.from_bytes(b[lo:hi], "big")
    return (hi - (differ.bit_length() + 7) // 8) // _WIDTH


_TAIL = 64 * _WIDTH  # bytes: a turn's answer and more


def _bounds(lcp: list[int], lengths: list[int]) -> list[list[int]]:
    """Per sorted path k, where its nodes past its lcp end, last first: its own end, and where later paths part
    from it, the running minima of lcp[k + 1:] that exceed lcp[k] (one stack of running minima, right to left:
    each value is pushed and popped once; the largest is at most the path's length)."""
    out: list[list[int]] = [[]] * len(lcp)
    minima: list[int] = []  # the running minima of lcp[k + 1:], the smallest at the bottom
    for k in range(len(lcp) - 1, -1, -1):
        at, bounds = lcp[k], [lengths[k]]
        while minima and minima[-1] > at:
            cut = minima.pop()
            if cut < bounds[0]:
                bounds.append(cut)
        if not minima or minima[-1] < at:
            minima.append(at)
        out[k] = bounds
    return out


def image_salt(ex) -> tuple:
    """What an example's tokens stand for besides their ids: its images (path and grid), () for text. Examples
    with other images share no node."""
    return tuple((ref.path, ref.grid_thw) for ref in getattr(ex, "images", ()))


def tree_salt(ex) -> tuple:
    """What keeps an example's path apart from others' with equal tokens: its images (:func:`image_salt`), and its
    preference pair or scored group: a pair's two answers (a group's K completions) are a subtree of their own under P
    (item -> {chosen, rejected}), which fits a pack whenever the pair does, so the pack cutter never parts them."""
    pair, group = getattr(ex, "pair", ""), getattr(ex, "group", "")
    return image_salt(ex) + ((("pair", pair),) if pair else ()) + ((("group", group),) if group else ())


def example_keys(examples: Sequence) -> tuple[list[bytes], list[tuple] | None]:
    """Examples' paths, each one's continuation (item + target), as keys (path_key), and their salts (tree_salt;
    None when no example has images, a pair or a group: the same tree, sorted faster)."""
    salted = any(getattr(ex, "images", ()) or getattr(ex, "pair", "") or getattr(ex, "group", "") for ex in examples)
    salts = [tree_salt(ex) for ex in examples] if salted else None
    return _keys([ex.item_ids for ex in examples], [ex.target_ids for ex in examples]), salts


def continuations(examples: Sequence) -> Callable[[int], tuple[int, ...]]:
    """Path j's tokens for tree_of_keys: example j's item + target."""
    return lambda j: examples[j].item_ids + examples[j].target_ids


def example_tree(examples: Sequence) -> Tree:
    """The tree of examples of one prompt group."""
    return tree_of_keys(*example_keys(examples), continuations(examples))
