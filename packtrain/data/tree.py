"""The prefix tree of a prompt group's continuations (``packing.mode: tree``), pure Python.

Every example is a path from the root (P) through its continuation's tokens (item + target). Continuations that
start with the same tokens share them: the tree keeps each shared run once, as one *node* (a radix tree: a node
ends where two paths part or a path ends inside a longer one's run only when nothing follows it on its own). A
node's tokens are positions ``[start, start + length)`` of every path through it, counted after P.

Built from the paths sorted by their tokens, so the tree, its node order and everything derived from it depend on
the examples' tokens only, never on their input order. Nodes are numbered in depth-first order (a parent before
its children, children by their first token): the order a tree pack lays them out in one buffer.

Shapes: a tree of n paths of total length L has at most 2n nodes; building it is O(L log n) (the sort).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
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
    """The radix tree of ``paths`` (token sequences after P; duplicates and paths that are prefixes of others
    allowed; an empty path runs through no node). Paths with different ``salts`` (any orderable values, e.g. the
    images an example's tokens stand for) share no node: equal tokens are not equal inputs there.

    The paths in sorted order: each shares with the tree what it shares with the path before it (their common
    prefix), so the previous path's nodes past that point are left, the one the common prefix ends inside is split
    there, and the rest of the path is a new node."""
    salt = (lambda i: salts[i]) if salts is not None else (lambda i: ())
    order = sorted(range(len(paths)), key=lambda i: (salt(i), tuple(paths[i]), i))
    nodes: list[Node] = []
    salt_of: list = []  # per node
    ending: dict[int, list[int]] = {}  # node -> the paths that end at its end
    stack: list[int] = []  # the previous path's nodes, root side first
    prev: tuple[int, ...] = ()
    prev_salt = None
    for i in order:
        path = tuple(paths[i])
        common = _common(prev, path) if salt(i) == prev_salt else 0
        while stack and nodes[stack[-1]].start >= common:
            stack.pop()
        if stack and nodes[stack[-1]].end > common:
            _split(nodes, ending, stack[-1], common, salt_of)
        if common < len(path):
            parent = stack[-1] if stack else -1
            nodes.append(Node(parent, common, path[common:]))
            salt_of.append(salt(i))
            if parent >= 0:
                nodes[parent].children.append(len(nodes) - 1)
            stack.append(len(nodes) - 1)
        if path:
            ending.setdefault(stack[-1], []).append(i)
        prev, prev_salt = path, salt(i)
    ends = {i: n for n, ids in ending.items() for i in ids}
    return _depth_first(nodes, [ends.get(i, -1) for i in range(len(paths))], salt_of)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def _split(nodes: list[Node], ending: dict[int, list[int]], n: int, at: int, salt_of: list) -> None:
    """Node ``n`` keeps ``[start, at)``; a new child takes the rest, ``n``'s children and the paths that ended at
    ``n``'s end. (Every path through ``n`` so far runs through all of it: one that ended inside would sort before
    the path that made ``n``.)"""
    node = nodes[n]
    cut = at - node.start
    nodes.append(Node(n, at, node.tokens[cut:], node.children))
    salt_of.append(salt_of[n])
    child = len(nodes) - 1
    for k in node.children:
        nodes[k].parent = child
    node.tokens, node.children = node.tokens[:cut], [child]
    if n in ending:
        ending[child] = ending.pop(n)


def _depth_first(nodes: list[Node], ends: list[int], salt_of: list) -> Tree:
    """Renumbered in depth-first order, children by (salt, first token); each path's nodes from its last one."""
    first = lambda i: (salt_of[i], nodes[i].tokens[0])  # noqa: E731 - siblings differ in salt or first token
    order: list[int] = []
    todo = sorted((i for i, n in enumerate(nodes) if n.parent < 0), key=first, reverse=True)
    while todo:
        i = todo.pop()
        order.append(i)
        todo.extend(sorted(nodes[i].children, key=first, reverse=True))
    new = {old: k for k, old in enumerate(order)}
    out = [Node(new[nodes[old].parent] if nodes[old].parent >= 0 else -1, nodes[old].start, nodes[old].tokens,
                sorted(new[c] for c in nodes[old].children)) for old in order]
    paths = []
    for end in ends:
        chain, n = [], new[end] if end >= 0 else -1
        while n >= 0:
            chain.append(n)
            n = out[n].parent
        paths.append(chain[::-1])
    return Tree(out, paths)
