"""The walk (``packing.on_overflow: walk``): an example longer than the token budget, trained chunk by chunk on top
of P with gradient horizon H (definitions in :mod:`packtrain.data.walk_calls`).

Every window ``[w, e)`` of the standalone sequence runs through the model's own forward (no pack layout) from the
state of everything before ``w`` (:func:`packtrain.packed.prefix.run_span`: each attention layer's K/V, each GDN
layer's state and conv tail, as a :class:`~packtrain.packed.prefix.PrefixState`), and records the state it adds.
Each window is one call of :class:`packtrain.packed.lm.PackedLM` (the FSDP root), so its hooks run per window.

- ``horizon: all`` (exact; activation checkpointing over the sequence): P once with its graph kept (full
  context); the chunks forward under no_grad keeping every position's K/V and each boundary's GDN state and conv
  tail; then for chunks last..first: recompute the chunk with grad from leaf copies of its input state, backward
  its loss together with the gradients later chunks left on its outputs (K/V gradients accumulate from every later
  chunk that read them), and hand its input-state gradients to the chunk before; finally into P's graph
  (:func:`packtrain.packed.prefix.backward_through`, the chain rule the continuation groups use too).
- finite H: a no-grad forward in pieces cut at every window start, then per segment the window ``[w, e)`` with
  grad from constant state at ``w``, backward of the segment's loss.

A walked example counts as one example: each window's loss is its targets' cross-entropy sum over the example's
target count, so the windows add up to the per-example mean. Memory: K/V of all positions (needed anyway) and one
window's graph (chunk + horizon), never the whole example's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from packtrain.config import WalkSpec
from packtrain.data.walk_calls import WalkCalls, chunk_bounds, cuts, windows
from packtrain.packed.equal import filler_calls
from packtrain.packed.layout import PackLayout
from packtrain.packed.prefix import Pairs, PrefixState, backward_through, run_span
from packtrain.packed.rng import replay, rng_state


@dataclass
class WindowOut:
    loss: torch.Tensor  # scalar: this window's share of the per-example mean loss
    state: PrefixState  # K/V of [start, end); (conv tail, state) at end


@dataclass
class Window:
    """One call: positions ``[start, end)`` of the standalone ``layout`` from the state before ``start``; the loss
    of the targets read in ``[loss_from, end)`` over the example's target count ``n_targets``."""
    layout: PackLayout
    start: int
    end: int
    loss_from: int
    before: PrefixState
    n_targets: int

    def run(self, lm) -> WindowOut:
        """The window through ``lm``'s body (inside the FSDP root's hooks): its loss share and the state it adds."""
        lay, s, e = self.layout, self.start, self.end
        hidden, state = run_span(lm, lay, s, e, self.before)
        pos = lay.target_positions
        chosen = ((pos >= self.loss_from) & (pos < e)).nonzero()[:, 0]
        loss = lm.target_losses(hidden[0].index_select(0, pos[chosen] - s), lay.target_ids[chosen]).sum()
        return WindowOut(loss / self.n_targets, state)


# -- the walk ---------------------------------------------------------------------------------------------------
@dataclass
class WalkResult:
    loss: float  # the example's mean target loss
    target_tokens: int


class _Walk:
    def __init__(self, lm, layout: PackLayout, spec: WalkSpec, frozen: bool, scale: float, dummy: bool):
        self.lm, self.lay, self.spec, self.frozen, self.scale, self.dummy = lm, layout, spec, frozen, scale, dummy
        self.p = layout.prefix_len
        self.end = layout.length - 1  # the last token is read by no target
        self.n_targets = int(layout.target_ids.numel())
        self.kv_all: Pairs = {}  # every position's K/V, filled as the forward goes
        self.total = 0.0

    def call(self, start, end, loss_from, before: PrefixState) -> WindowOut:
        return self.lm(Window(self.lay, start, end, loss_from, before, self.n_targets))

    def dummy_call(self, grad: bool) -> None:
        """A call with the same collectives and nothing learned: position 0 alone, loss scaled by zero."""
        with torch.set_grad_enabled(grad):
            out = self.call(0, 1, 1, PrefixState())
        if grad:
            (out.loss * 0.0).backward()

    def store_kv(self, out: WindowOut, start: int) -> None:
        for i, (k, v) in out.state.kv.items():
            if i not in self.kv_all:
                shape = lambda t: t.shape[:-2] + (self.end, t.shape[-1])
                self.kv_all[i] = (k.new_zeros(shape(k)), v.new_zeros(shape(v)))
            n = k.shape[-2]
            self.kv_all[i][0][..., start:start + n, :] = k.detach()
            self.kv_all[i][1][..., start:start + n, :] = v.detach()

    def before(self, w: int, gdn: Pairs, leaf: bool = False) -> PrefixState:
        """The state of ``[0, w)``: the K/V stored so far (leaf copies collecting gradients when ``leaf``) and the
        GDN state and tails at ``w``."""
        kv = {}
        for i, (k, v) in self.kv_all.items():
            k, v = k[..., :w, :].detach(), v[..., :w, :].detach()
            kv[i] = (k.requires_grad_(), v.requires_grad_()) if leaf else (k, v)
        return PrefixState(kv, gdn)

    def backward(self, out: WindowOut, grads_kv: Pairs | None, grads_gdn: Pairs | None) -> None:
        """Backward of ``out.loss * scale`` plus the gradients later chunks left on the window's outputs."""
        grads = {("kv", i, j): g for i, pair in (grads_kv or {}).items() for j, g in enumerate(pair)}
        grads.update({("gdn", i, j): g for i, pair in (grads_gdn or {}).items() for j, g in enumerate(pair)})
        backward_through(self.lm, out.state, grads, losses=[out.loss * self.scale])

    # -- horizon all --------------------------------------------------------------------------------------------
    def exact(self, slot: WalkCalls) -> None:
        p, chunks = self.p, chunk_bounds(self.p, self.end, self.spec.chunk)
        if self.dummy:
            chunks = []
        with torch.set_grad_enabled(not self.frozen):  # P once; its graph kept for the end (full context)
            first = self.call(0, p, 0, PrefixState()) if not self.dummy else self.call(0, 1, 1, PrefixState())
        self.total += float(first.loss.detach())
        self.store_kv(first, 0)
        bounds = [{i: (t.detach(), s.detach()) for i, (t, s) in first.state.gdn.items()}]
        device, rng = self.lay.input_ids.device, []
        with torch.no_grad():
            for a, e in chunks:
                rng.append(rng_state(device))
                out = self.call(a, e, e, self.before(a, bounds[-1]))
                self.store_kv(out, a)
                bounds.append(out.state.gdn)
        filler_calls(len(chunks), slot.forwards, lambda: self.dummy_call(grad=False))
        g_kv = {i: (torch.zeros_like(k), torch.zeros_like(v)) for i, (k, v) in self.kv_all.items()}
        g_gdn = None
        for c in reversed(range(len(chunks))):
            a, e = chunks[c]
            gdn_in = {i: (t.clone().requires_grad_(), s.clone().requires_grad_()) for i, (t, s) in bounds[c].items()}
            state_in = self.before(a, gdn_in, leaf=True)
            with replay(rng[c], device):
                out = self.call(a, e, a, state_in)
            self.backward(out, {i: (gk[..., a:e, :], gv[..., a:e, :]) for i, (gk, gv) in g_kv.items()}, g_gdn)
            self.total += float(out.loss.detach())
            for i, (k, v) in state_in.kv.items():
                for acc, leaf in ((g_kv[i][0], k), (g_kv[i][1], v)):
                    if leaf.grad is not None:
                        acc[..., :a, :] += leaf.grad
            g_gdn = {i: tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in pair)
                     for i, pair in gdn_in.items()}
        filler_calls(len(chunks), slot.backwards, lambda: self.dummy_call(grad=True))
        if not self.frozen:  # into P's graph: its own loss, the K/V every chunk read, the first chunk's state
            n = 1 if self.dummy else p
            self.backward(first, {i: (gk[..., :n, :], gv[..., :n, :]) for i, (gk, gv) in g_kv.items()}, g_gdn)

    # -- finite horizon -----------------------------------------------------------------------------------------
    def truncated(self, slot: WalkCalls, item_len: int) -> None:
        p, spec = self.p, self.spec
        length = self.end + 1 - p
        points = [] if self.dummy else cuts(p, item_len, length, spec, self.frozen)
        wins = [] if self.dummy else windows(p, item_len, length, spec, self.frozen)
        states: dict[int, Pairs] = {0: {}}
        with torch.no_grad():  # losses counted here only where no window computes them: P's under frozen
            for s, e in itertools.pairwise(points):
                loss_from = 0 if (self.frozen and e <= p) else e
                out = self.call(s, e, loss_from, self.before(s, states[s]))
                self.total += float(out.loss.detach())
                self.store_kv(out, s)
                states[e] = out.state.gdn
        filler_calls(max(len(points) - 1, 0), slot.forwards, lambda: self.dummy_call(grad=False))
        for w, a, e in wins:
            out = self.call(w, e, a, self.before(w, states[w]))
            self.backward(out, None, None)
            self.total += float(out.loss.detach())
        filler_calls(len(wins), slot.backwards, lambda: self.dummy_call(grad=True))


def train_walk(lm, layout: PackLayout, spec: WalkSpec, scale: float, slot: WalkCalls,
               dummy: bool = False) -> WalkResult:
    """Forward and backward of one walked example (gradients accumulate into the parameters, scaled by
    ``scale``); ``slot`` is the walk calls every rank issues in this slot
    (:func:`packtrain.data.walk_calls.walk_calls`)."""
    lm.context.check_walk()
    walk = _Walk(lm, layout, spec, not lm.context.prefix_in_graph, scale, dummy)
    if spec.horizon is None:
        walk.exact(slot)
    else:
        item_len = int(layout.target_positions[0]) + 1 - walk.p  # the first target is read at |P| + item - 1
        walk.truncated(slot, item_len)
    return WalkResult(walk.total, walk.n_targets)


@torch.no_grad()
def eval_walk(lm, layout: PackLayout, spec: WalkSpec, chunks: int, dummy: bool = False) -> WalkResult:
    """The example's loss, chunk by chunk under no_grad (``chunks``: the count every rank issues in this slot)."""
    walk = _Walk(lm, layout, spec, False, 0.0, dummy)
    bounds = [] if dummy else [(0, walk.p)] + chunk_bounds(walk.p, walk.end, spec.chunk)
    gdn: Pairs = {}
    for s, e in bounds:
        out = walk.call(s, e, s, walk.before(s, gdn))
        walk.total += float(out.loss)
        walk.store_kv(out, s)
        gdn = out.state.gdn
    filler_calls(len(bounds), chunks + 1, lambda: walk.dummy_call(grad=False))
    return WalkResult(walk.total, walk.n_targets)
