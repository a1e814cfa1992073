"""The query-key pairs of causal attention, per layer and head, of every buffer packtrain runs: one sequence alone, a
pack (P and each continuation against P and itself) and a prefix tree (each node's tokens against P, their
ancestors and their own node's earlier tokens). The cost model (:mod:`packtrain.run.balance`), ``plan``'s figures
and the step-time estimate (:mod:`packtrain.memory.savings`) count with these."""

from __future__ import annotations

from collections.abc import Iterable


def causal_pairs(length: int) -> int:
    """One sequence of ``length`` positions: 1 + 2 + ... + length."""
    return length * (length + 1) // 2


def pack_pairs(prefix_len: int, cont_lens: Iterable[int]) -> int:
    """A pack: P's own, and each continuation against P and itself."""
    return causal_pairs(prefix_len) + sum(c * prefix_len + causal_pairs(c) for c in cont_lens)


def node_pairs(start: int, end: int) -> int:
    """What a tree node's tokens (positions [start, end) after P) add past P's keys: the token at position q (counted
    after P, from 0) reads q + 1 keys there (its ancestors' tokens, its node's earlier tokens and itself),
    1 + 2 + ... + end less 1 + 2 + ... + start."""
    return causal_pairs(end) - causal_pairs(start)


def tree_pairs(prefix_len: int, positions: int, nodes_pairs: int) -> int:
    """A tree pack of ``positions`` tokens after P whose nodes add ``nodes_pairs`` (the sum of :func:`node_pairs`):
    P's own, every token reading P, and the nodes' own."""
    return causal_pairs(prefix_len) + prefix_len * positions + nodes_pairs
