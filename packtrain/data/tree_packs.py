"""A prefix tree's paths cut into packs (``packing.mode: tree``, :func:`pack_tree`): each pack is a set of the tree's
subtrees of at most the budget's tokens and ``packing.max_continuations`` leaves, counted exactly; and the causal
attention pairs a tree's tokens add. Pure Python, on the columns of :class:`packtrain.data.prefix_tree.Tree`."""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from itertools import accumulate, compress
from operator import eq, sub

from packtrain.data.attention_pairs import node_pairs, tree_pairs
from packtrain.data.prefix_tree import Tree


def attention_pairs(prefix_len: int, tree: Tree) -> int:
    """A tree pack's query-key pairs of causal attention (:func:`packtrain.data.attention_pairs.tree_pairs`)."""
    return tree_pairs(prefix_len, tree.positions, sum(map(node_pairs, tree.start, tree.end)))


@dataclass(frozen=True)
class TreePack:
    paths: tuple[int, ...]  # path indices, by their last node in depth-first order (ties: ``tie``)
    positions: int  # tokens of the pack's tree (after P)
    attention_pairs: int  # sum of node_pairs over the pack's tree (P's keys not counted)
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
