"""The prefix tree of a prompt group's continuations (``packing.mode: tree``), pure Python.

Every example is a path from the root (P) through its continuation's tokens (item + target). Continuations that
start with the same tokens share them: the tree keeps each shared run once, as one *node* (a radix tree: a node
ends where two paths part, or where a path ends). A node's tokens are positions ``[start, start + length)`` of
every path through it, counted after P. Packs of a tree (``pack_tree``) are sets of its subtrees.

Built from the paths sorted by their tokens, so the tree, its node order and everything derived from it depend on
the examples' tokens only, never on their input order. Nodes are numbered in depth-first order (a parent before
its children, children by their first token): the order a tree pack lays them out in one buffer.

Shapes: a tree of n paths of total length L has at most 2n nodes; building it is O(L log n) (the sort).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass, field


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
    nodes: list[Node]  # depth-first order
    # per path (in the input order): the nodes it runs through, root side first
    paths: list[list[int]]

    @property
    def positions(self) -> int:
        """The tokens of every node: what a tree pack computes after P."""
        return sum(len(n.tokens) for n in self.nodes)

    def ancestors(self, node: int) -> list[int]:
        """``node``'s ancestors, root side first (``node`` not included)."""
        out = []
        while self.nodes[node].parent >= 0:
            node = self.nodes[node].parent
            out.append(node)
        return out[::-1]

    def node_at(self, path: int, position: int) -> int:
        """The node holding position ``position`` (counted after P) of path ``path``."""
        for n in self.paths[path]:
            if self.nodes[n].start <= position < self.nodes[n].end:
                return n
        raise IndexError(f"position {position} is past the end of path {path}")


def build_tree(paths: Sequence[Sequence[int]], salts: Sequence | None = None) -> Tree:
    """The radix tree of ``paths`` (token sequences after P; duplicates and paths that are
    prefixes of others allowed; an empty path runs through no node). Paths with different ``salts`` (any orderable
    values, e.g. the images an example's tokens stand for) share no node: equal tokens are not equal inputs there.

    The paths in sorted order (salt, then tokens; tuples compare in C), with the common prefix of each with the one before it (the
    *lcp*). In that order a depth-first walk meets each path's nodes past its lcp for the first time, so nodes are
    made in depth-first order, never split: a path's nodes past its lcp end where a later path parts from it (the
    running minima of the later lcps, found with one stack from the right) and at its own end."""
    paths = [tuple(p) for p in paths]
    if salts is None:
        order = sorted(range(len(paths)), key=paths.__getitem__)
    else:
        order = sorted(range(len(paths)), key=lambda i: (salts[i], paths[i]))
    ordered = [paths[i] for i in order]
    lcp = [0, *map(_common, ordered, ordered[1:])]
    if salts is not None:  # the first path of each salt shares nothing with the one before it
        lcp = [c if k == 0 or salts[order[k - 1]] == salts[order[k]] else 0 for k, c in enumerate(lcp)]
    cuts = _cuts(lcp)
    nodes: list[Node] = []
    chains: list[list[int]] = [[] for _ in paths]
    stack: list[int] = []  # the previous path's nodes, root side first
    ends: list[int] = []  # their ends
    for i, path, start, cut in zip(order, ordered, lcp, cuts):
        while ends and ends[-1] > start:
            stack.pop()
            ends.pop()
        for end in ([*(c for c in reversed(cut) if c < len(path)), len(path)] if cut else (len(path),)):
            if end > start:
                parent = stack[-1] if stack else -1
                nodes.append(Node(parent, start, path[start:end]))
                if parent >= 0:
                    nodes[parent].children.append(len(nodes) - 1)
                stack.append(len(nodes) - 1)
                ends.append(end)
                start = end
        chains[i] = stack[:]
    return Tree(nodes, chains)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The tokens ``b`` starts with in common with ``a``, where ``a <= b``. Neighbours in sorted order mostly part
    early (another conversation) or not at all (``a`` a prefix of ``b``: the next turn), so those two are tried
    first; else a bisection that compares only the slice still in doubt (it halves: about 2 len(a) tokens
    compared, in C)."""
    head = min(len(a), _HEAD)
    if a[:head] != b[:head]:
        lo, hi = 0, head  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    elif b[:len(a)] == a:
        return len(a)
    else:
        lo, hi = head, min(len(a), len(b))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


_HEAD = 16  # tokens compared first: a chat turn's opening (role tokens) and a little more


def _cuts(lcp: list[int]) -> list[list[int]]:
    """Per sorted path k, where later paths part from it past its own lcp: the running minima of lcp[k + 1:] that
    exceed lcp[k], largest first (one stack of running minima, right to left: each value is pushed and popped
    once)."""
    cuts: list[list[int]] = [[] for _ in lcp]
    minima: list[int] = []  # the running minima of lcp[k + 1:], the smallest at the bottom
    for k in range(len(lcp) - 1, -1, -1):
        while minima and minima[-1] > lcp[k]:
            cuts[k].append(minima.pop())
        if not minima or minima[-1] < lcp[k]:
            minima.append(lcp[k])
    return cuts


def node_pairs(node: Node) -> int:
    """What ``node``'s tokens add to causal attention past P's keys: the token at position q (counted after P,
    from 0) reads q + 1 keys there (its ancestors' tokens, its node's earlier tokens and itself)."""
    length = len(node.tokens)
    return length * node.start + length * (length + 1) // 2


def attention_pairs(prefix_len: int, tree: Tree) -> int:
    """A tree pack's query-key pairs of causal attention: P's own, and each node's token reading P, its ancestors
    and its own node's earlier tokens, ``len * (|P| + start) + len * (len + 1) / 2`` per node."""
    return prefix_len * (prefix_len + 1) // 2 + prefix_len * tree.positions + sum(map(node_pairs, tree.nodes))


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
    """
    nodes = tree.nodes
    n = len(nodes)
    size, count, leaves, pairs = _subtree_sums(nodes)
    ends: list[list[int]] = [[] for _ in range(n)]
    for j, chain in enumerate(tree.paths):
        ends[chain[-1]].append(j)
    if tie is not None:
        for e in ends:
            if len(e) > 1:
                e.sort(key=tie)
    rank = [0] * len(tree.paths)  # a path's place in depth-first order of last nodes, then ``tie``
    for r, j in enumerate(j for e in ends for j in e):
        rank[j] = r
    items = []  # (-full cost, node, is an end item)
    todo = [i for i in range(n) if nodes[i].parent < 0]
    while todo:
        i = todo.pop()
        if nodes[i].start + size[i] <= capacity and leaves[i] <= max_leaves:
            items.append((-(nodes[i].start + size[i]), i, False))
        else:
            if ends[i]:
                items.append((-nodes[i].end, i, True))
            todo.extend(nodes[i].children)
    items.sort()
    packer = _Packer(nodes, capacity, max_leaves, len(items) + 1)
    for _, i, end_item in items:
        if end_item:
            packer.add_end(i, ends[i])
        else:
            packer.add_subtree(i, size[i], leaves[i], pairs[i], [j for k in range(i, i + count[i]) for j in ends[k]])
    return packer.packs(rank.__getitem__)


def _subtree_sums(nodes: list[Node]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per node, over its subtree: tokens, nodes (a subtree is a run of depth-first indices), leaves, node_pairs."""
    size = [len(node.tokens) for node in nodes]
    pairs = list(map(node_pairs, nodes))
    count, leaves = [1] * len(nodes), [0] * len(nodes)
    for i in range(len(nodes) - 1, -1, -1):  # children come after their parent
        leaves[i] = leaves[i] or 1
        p = nodes[i].parent
        if p >= 0:
            size[p] += size[i]
            count[p] += count[i]
            leaves[p] += leaves[i]
            pairs[p] += pairs[i]
    return size, count, leaves, pairs


class _Packer:
    """pack_tree's packs as they fill. Open packs (fewer than max_leaves leaves) sit in sorted lists of
    ``room * stride + pack``: one of all of them, and one per split node of those that hold it; bisect finds the
    least room that fits, ties to the oldest pack."""

    def __init__(self, nodes: list[Node], capacity: int, max_leaves: int, stride: int):
        self.nodes, self.capacity, self.max_leaves, self.stride = nodes, capacity, max_leaves, stride
        self.room: list[int] = []
        self.leaves: list[int] = []
        self.pairs: list[int] = []
        self.paths: list[list[int]] = []
        self.held: list[list[int]] = []  # per pack, the split nodes it holds
        self.open_all: list[int] = []
        self.open_at: dict[int, list[int]] = {}  # split node -> open packs holding it
        self.holders: dict[int, list[int]] = {}  # split node -> every pack holding it

    def add_end(self, node: int, paths: list[int]) -> None:
        """The paths ending at split node ``node``: into the pack holding it with the least room (ties: oldest)."""
        b = min(self.holders[node], key=lambda b: (self.room[b], b))
        self.paths[b].extend(paths)

    def add_subtree(self, root: int, size: int, leaves: int, pairs: int, paths: list[int]) -> None:
        chain = self._split_chain(self.nodes[root].parent)  # deepest first
        anchor_end = self.nodes[chain[0]].end if chain else 0
        for level, h in enumerate([*chain, -1]):
            need = size + anchor_end - (self.nodes[h].end if h >= 0 else 0)
            b = self._best_fit(self.open_at.get(h, []) if h >= 0 else self.open_all, need, leaves)
            if b is not None:
                break
        else:
            b, level = self._new_pack(), len(chain)
        self._unlist(b)
        for g in chain[:level]:  # the split nodes the pack did not hold
            self.held[b].append(g)
            self.holders.setdefault(g, []).append(b)
            self.room[b] -= len(self.nodes[g].tokens)
            self.pairs[b] += node_pairs(self.nodes[g])
        self.room[b] -= size
        # the split node the pack already held has a held child (what brought it there lies below it), so it was no
        # leaf: the pack gains exactly the subtree's leaves
        self.leaves[b] += leaves
        self.pairs[b] += pairs
        self.paths[b].extend(paths)
        self._list(b)

    def _split_chain(self, anchor: int) -> list[int]:
        chain = []
        while anchor >= 0:
            chain.append(anchor)
            anchor = self.nodes[anchor].parent
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

    def packs(self, order) -> list[TreePack]:
        """The packs, each one's paths sorted by ``order``."""
        return [TreePack(tuple(sorted(self.paths[b], key=order)), self.capacity - self.room[b], self.pairs[b],
                         self.leaves[b])
                for b in range(len(self.room))]


def image_salt(ex) -> tuple:
    """What an example's tokens stand for besides their ids: its images (path and grid), () for text. Examples
    with other images share no node."""
    return tuple((ref.path, ref.grid_thw) for ref in getattr(ex, "images", ()))


def example_paths(examples: Sequence) -> tuple[list[tuple[int, ...]], list[tuple] | None]:
    """Examples' paths, each one's continuation (item + target), and their salts, their images (None when none
    has images: the same tree, sorted faster)."""
    salts = [image_salt(ex) for ex in examples] if any(getattr(ex, "images", ()) for ex in examples) else None
    return [ex.item_ids + ex.target_ids for ex in examples], salts


def example_tree(examples: Sequence) -> Tree:
    """The tree of examples of one prompt group."""
    return build_tree(*example_paths(examples))
