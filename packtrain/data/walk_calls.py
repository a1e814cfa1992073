"""The walk's calls (``packing.on_overflow: walk``), pure Python: what a walked example runs, so the planner can
count it and every rank can pad its calls to the same sequence before any of them runs.

An example whose P + continuation exceeds ``packing.token_budget`` is walked (:mod:`packtrain.packed.walk`): over its
standalone sequence ``concat(P, C)`` of T positions, P is segment 0 ``[0, |P|)`` and the continuation is cut into
chunks of ``walk.chunk`` positions ``[a, e)`` covering ``[|P|, T - 1)`` (the last token is read by no target, so
nothing is computed for it). A target belongs to the segment holding the position its logit is read off.

``walk.horizon`` H (tokens, or ``all``): the loss of a segment starting at ``a`` is differentiated through the
positions ``[max(lo, a - H), e)`` only. Everything before ``w = max(lo, a - H)`` -- the attention K/V of those
positions, the GDN state at ``w`` and the conv inputs of the W-1 positions before ``w`` -- is a constant for that
segment's gradient. ``lo`` is 0 under ``packing.context_grad: full`` (the window may reach into P) and |P| under
``frozen`` (P is always a constant). ``H = all`` is the exact gradient of the whole example; ``H = 0`` is the draft
walk (earlier chunks are constants).
"""

from __future__ import annotations

from dataclasses import dataclass

from packtrain.config import WalkSpec


@dataclass(frozen=True)
class WalkCalls:
    """The calls of one walked example through the model: ``forwards`` no-grad forwards, then ``backwards``
    forward+backward windows (besides P's own forward and, under full context with horizon all, its backward).
    Ranks pad each field to the largest in the same slot, so FSDP sees the same collectives everywhere."""
    chunks: int
    forwards: int
    backwards: int

    def pad(self, other: WalkCalls) -> WalkCalls:
        return WalkCalls(max(self.chunks, other.chunks), max(self.forwards, other.forwards),
                        max(self.backwards, other.backwards))


def chunk_bounds(p: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """The continuation chunks ``[a, e)`` covering ``[p, end)``."""
    return [(a, min(a + chunk, end)) for a in range(p, end, chunk)]


def windows(p: int, item_len: int, length: int, spec: WalkSpec, frozen: bool) -> list[tuple[int, int, int]]:
    """Finite horizon: per segment with gradient, ``(w, a, e)``: compute ``[w, e)`` from constants at ``w``, loss of
    the targets read in ``[a, e)``. P's own segment (a target read off P's last row: no item) under full context."""
    assert spec.horizon is not None
    lo = p if frozen else 0
    out = [(max(lo, a - spec.horizon), a, e) for a, e in chunk_bounds(p, p + length - 1, spec.chunk)]
    if item_len == 0 and not frozen:
        out.insert(0, (0, 0, p))
    return out


def cuts(p: int, item_len: int, length: int, spec: WalkSpec, frozen: bool) -> list[int]:
    """Finite horizon: the boundaries of the no-grad forward pieces (every window's start and every chunk's)."""
    end = p + length - 1
    points = {0, p, end} | {a for a, _ in chunk_bounds(p, end, spec.chunk)}
    points |= {w for w, _, _ in windows(p, item_len, length, spec, frozen)}
    return sorted(x for x in points if x <= end)


def walk_calls(p: int, item_len: int, length: int, spec: WalkSpec, frozen: bool = False) -> WalkCalls:
    n = len(chunk_bounds(p, p + length - 1, spec.chunk))
    if spec.horizon is None:
        return WalkCalls(n, n, n)
    return WalkCalls(n, len(cuts(p, item_len, length, spec, frozen)) - 1, len(windows(p, item_len, length, spec,
                                                                                     frozen)))
