"""The prefix tree of a prompt group's continuations (``packing.mode: tree``), pure Python.

Every example is a path from the root (P) through its continuation's tokens (item + target). Continuations that
start with the same tokens share them: the tree keeps each shared run once, as one *node* (a radix tree: a node
ends where two paths part, or where a path ends). A node's tokens are positions ``[start, start + length)`` of
every path through it, counted after P. Packs of a tree (``pack_tree``) are sets of its subtrees.

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
from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate, compress
from operator import eq, sub

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


def node_pairs(start: int, end: int) -> int:
    """What a node's tokens (positions [start, end) after P) add to causal attention past P's keys: the token at
    position q (counted after P, from 0) reads q + 1 keys there (its ancestors' tokens, its node's earlier tokens
    and itself), 1 + 2 + ... + end less 1 + 2 + ... + start."""
    return (end * (end + 1) - start * (start + 1)) // 2


def attention_pairs(prefix_len: int, tree: Tree) -> int:
    """A tree pack's query-key pairs of causal attention: P's own, and each node's token reading P, its ancestors
    and its own node's earlier tokens, ``len * (|P| + start) + len * (len + 1) / 2`` per node."""
    return (prefix_len * (prefix_len + 1) // 2 + prefix_len * tree.positions
            + sum(map(node_pairs, tree.start, tree.end)))


@dataclass(frozen=True)
class TreePack:
    paths: tuple[int, ...]  # path indices, by their last node in depth-first order (ties: ``tie``)
    positions: int  # tokens of the pack's tree (after P)
    pairs: int  # sum of node_pairs over the pack's tree (P's keys not counted)
    leaves: int  # distinct leaves of the pack's tree


def pack_tree(tree: Tree, capacity: int, max_leaves: int, tie=None) -> list[TreePack]:
    """The paths of ``tree`` in packs of at most ``capacity`` tree tokens and ``max_leaves`` leaves, each pack the
    tree of its paths (every path non-empty and fitting alone: ``1 <= len(path) <= capacity``).

    Items: from the roots down, a node whose subtree fits with its path (``start + subtree tokens <= capacity``,
    its leaves <= ``max_leaves``) is one item, every path ending in it; a node that does not fit is *split*: the
    paths ending at its end are one item (an *end* item), and its children are visited. An item's *anchor* is the
    split node it hangs under (its parent, or for an end item its own node); the anchor and its ancestors are the
    split nodes on the item's path.

    Packing: items by full cost (path + subtree tokens) descending, ties by node index. Each goes to the pack that
    holds the deepest of its split nodes among those with room for what the item adds there (its subtree and the
    split nodes below that one), the least room left first (best fit), ties to the oldest pack; a new pack when
    none has room. An end item always finds its node held (every item below a node comes before it, and a split
    node has items below it), so it adds no token and no leaf. What a pack holds is counted exactly: the tokens
    and leaves of its subtrees and split nodes.

    Subtrees are runs of depth-first indices, so a subtree's tokens, leaves and pairs are differences of prefix
    sums, and its paths (by last node, then ``tie``) one run of the paths in that order.
    """
    start, end, stop = tree.start, tree.end, tree.stop
    n = len(stop)
    tokens = [0, *accumulate(map(sub, end, start))]
    leaves = [0, *accumulate(map(eq, stop, range(1, n + 1)))]  # a leaf's subtree is itself
    pairs = [0, *accumulate(map(node_pairs, start, end))]
    ranked = tree.by_last[:]
    lasts = list(map(tree.last.__getitem__, ranked))
    if tie is not None:
        _sort_ties(ranked, lasts, tie)
    items = []  # (-full cost, node, is an end item)
    todo = _children(stop, -1, n)
    while todo:
        i = todo.pop()
        size = tokens[stop[i]] - tokens[i]
        if start[i] + size <= capacity and leaves[stop[i]] - leaves[i] <= max_leaves:
            items.append((-(start[i] + size), i, False))
        else:
            if bisect_left(lasts, i + 1) > bisect_left(lasts, i):
                items.append((-end[i], i, True))
            todo.extend(_children(stop, i, stop[i]))
    items.sort()
    packer = _Packer(tree, capacity, max_leaves, len(items) + 1)
    for _, i, end_item in items:
        if end_item:
            packer.add_end(i, (bisect_left(lasts, i), bisect_left(lasts, i + 1)))
        else:
            j = stop[i]
            packer.add_subtree(i, tokens[j] - tokens[i], leaves[j] - leaves[i], pairs[j] - pairs[i],
                               (bisect_left(lasts, i), bisect_left(lasts, j)))
    return packer.packs(ranked)


def _children(stop: list[int], node: int, until: int) -> list[int]:
    """The children of ``node`` (-1: the roots), whose subtree ends at ``until``: each child's subtree is followed by
    its next sibling's."""
    out = []
    child = node + 1
    while child < until:
        out.append(child)
        child = stop[child]
    return out


def _sort_ties(ranked: list[int], lasts: list[int], tie) -> None:
    """Paths with the same last node (the runs of equal ``lasts``) sorted by ``tie``, in place."""
    runs: list[list[int]] = []
    for k in compress(range(1, len(lasts)), map(eq, lasts, lasts[1:])):  # lasts[k] == lasts[k - 1]
        if runs and runs[-1][1] == k:
            runs[-1][1] = k + 1
        else:
            runs.append([k - 1, k + 1])
    for lo, hi in runs:
        ranked[lo:hi] = sorted(ranked[lo:hi], key=tie)


class _Packer:
    """pack_tree's packs as they fill. Open packs (fewer than max_leaves leaves) sit in sorted lists of
    ``room * stride + pack``: one of all of them, and one per split node of those that hold it; bisect finds the
    least room that fits, ties to the oldest pack. A pack's paths are runs ``(lo, hi)`` of pack_tree's ranked paths."""

    def __init__(self, tree: Tree, capacity: int, max_leaves: int, stride: int):
        self.parent, self.start, self.end = tree.parent, tree.start, tree.end
        self.capacity, self.max_leaves, self.stride = capacity, max_leaves, stride
        self.room: list[int] = []
        self.leaves: list[int] = []
        self.pairs: list[int] = []
        self.paths: list[list[tuple[int, int]]] = []
        self.held: list[list[int]] = []  # per pack, the split nodes it holds
        self.open_all: list[int] = []
        self.open_at: dict[int, list[int]] = {}  # split node -> open packs holding it
        self.holders: dict[int, list[int]] = {}  # split node -> every pack holding it

    def add_end(self, node: int, paths: tuple[int, int]) -> None:
        """The paths ending at split node ``node``: into the pack holding it with the least room (ties: oldest)."""
        b = min(self.holders[node], key=lambda b: (self.room[b], b))
        self.paths[b].append(paths)

    def add_subtree(self, root: int, size: int, leaves: int, pairs: int, paths: tuple[int, int]) -> None:
        chain = self._split_chain(self.parent[root])  # deepest first
        anchor_end = self.end[chain[0]] if chain else 0
        for level, h in enumerate([*chain, -1]):
            need = size + anchor_end - (self.end[h] if h >= 0 else 0)
            b = self._best_fit(self.open_at.get(h, []) if h >= 0 else self.open_all, need, leaves)
            if b is not None:
                break
        else:
            b, level = self._new_pack(), len(chain)
        self._unlist(b)
        for g in chain[:level]:  # the split nodes the pack did not hold
            self.held[b].append(g)
            self.holders.setdefault(g, []).append(b)
            self.room[b] -= self.end[g] - self.start[g]
            self.pairs[b] += node_pairs(self.start[g], self.end[g])
        self.room[b] -= size
        # the split node the pack already held has a held child (what brought it there lies below it), so it was no
        # leaf: the pack gains exactly the subtree's leaves
        self.leaves[b] += leaves
        self.pairs[b] += pairs
        self.paths[b].append(paths)
        self._list(b)

    def _split_chain(self, anchor: int) -> list[int]:
        chain = []
        while anchor >= 0:
            chain.append(anchor)
            anchor = self.parent[anchor]
        return chain

    def _best_fit(self, keys: list[int], need: int, leaves: int) -> int | None:
        for k in range(bisect_left(keys, need * self.stride), len(keys)):
            b = keys[k] % self.stride
            if self.leaves[b] + leaves <= self.max_leaves:
                return b
        return None

    def _new_pack(self) -> int:
        for column, empty in ((self.room, self.capacity), (self.leaves, 0), (self.pairs, 0), (self.paths, None),
                              (self.held, None)):
            column.append([] if empty is None else empty)
        return len(self.room) - 1

    def _lists(self, b: int) -> list[list[int]]:
        return [self.open_all, *(self.open_at.setdefault(g, []) for g in self.held[b])]

    def _unlist(self, b: int) -> None:
        key = self.room[b] * self.stride + b
        for keys in self._lists(b):
            k = bisect_left(keys, key)
            if k < len(keys) and keys[k] == key:
                del keys[k]

    def _list(self, b: int) -> None:
        if self.leaves[b] < self.max_leaves:
            key = self.room[b] * self.stride + b
            for keys in self._lists(b):
                insort(keys, key)

    def packs(self, ranked: list[int]) -> list[TreePack]:
        """The packs, each one's paths in the order of ``ranked``."""
        out = []
        for b in range(len(self.room)):
            paths: list[int] = []
            for lo, hi in sorted(self.paths[b]):
                paths += ranked[lo:hi]
            out.append(TreePack(tuple(paths), self.capacity - self.room[b], self.pairs[b], self.leaves[b]))
        return out


def image_salt(ex) -> tuple:
    """What an example's tokens stand for besides their ids: its images (path and grid), () for text. Examples
    with other images share no node."""
    return tuple((ref.path, ref.grid_thw) for ref in getattr(ex, "images", ()))


def example_keys(examples: Sequence) -> tuple[list[bytes], list[tuple] | None]:
    """Examples' paths, each one's continuation (item + target), as keys (path_key), and their salts, their images
    (None when none has images: the same tree, sorted faster)."""
    salts = [image_salt(ex) for ex in examples] if any(getattr(ex, "images", ()) for ex in examples) else None
    return _keys([ex.item_ids for ex in examples], [ex.target_ids for ex in examples]), salts


def continuations(examples: Sequence) -> Callable[[int], tuple[int, ...]]:
    """Path j's tokens for tree_of_keys: example j's item + target."""
    return lambda j: examples[j].item_ids + examples[j].target_ids


def example_tree(examples: Sequence) -> Tree:
    """The tree of examples of one prompt group."""
    return tree_of_keys(*example_keys(examples), continuations(examples))
