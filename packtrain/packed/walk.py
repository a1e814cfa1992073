"""The walk (``packing.on_overflow: walk``, seed 001): an example longer than the token budget, trained chunk by
chunk on top of P with gradient horizon H (definitions in :mod:`packtrain.data.walk_schedule`).

Every window ``[w, e)`` of the standalone sequence runs through the model's own forward (no pack layout) with a
:class:`WindowCache`: transformers' cache interface over the caches of everything before ``w`` -- each attention
layer's K/V (after k_norm and RoPE), each GDN layer's state and conv tail (its last W-1 pre-conv inputs), as
:class:`packtrain.packed.context.PrefixCache` reads P's for the frozen context -- which records what the window adds. The
cache is stateless (inputs in, outputs recorded), so a checkpointed layer's recompute sees the same inputs again.
Each window is one call of :class:`packtrain.packed.lm.PackedLM` (the FSDP root), so its hooks run per window.

- ``horizon: all`` (exact; activation checkpointing over the sequence): P once with its graph kept (full
  context); the chunks forward under no_grad keeping every position's K/V and each boundary's GDN state and conv
  tail; then for chunks last..first: recompute the chunk with grad from leaf copies of its input caches, backward
  its loss together with the gradients later chunks left on its outputs (K/V gradients accumulate from every later
  chunk that read them), and hand its input-cache gradients to the chunk before; finally into P's graph.
- finite H: a no-grad forward in pieces cut at every window start, then per segment the window ``[w, e)`` with
  grad from constant caches at ``w``, backward of the segment's loss.

A walked example counts as one example: each window's loss is its targets' cross-entropy sum over the example's
target count, so the windows add up to the per-example mean. Memory: K/V of all positions (needed anyway) and one
window's graph (chunk + horizon), never the whole example's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from packtrain.data.walk_schedule import Schedule, WalkSpec, chunk_bounds, cuts, windows
from packtrain.packed.layout import PackLayout
from packtrain.packed.patch import packed_positions, text_parts

KV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # attention layer -> (keys, values) [1, G, positions, D]
GDN = dict[int, tuple[torch.Tensor, torch.Tensor]]  # GDN layer -> (conv tail [1, C, W-1], state [1, HV, K, V])


class WindowCache(DynamicCache):
    """The caches of the positions before a window as transformers' cache interface; records the window's own."""

    def __init__(self, config, kv: KV, gdn: GDN):
        super().__init__(config=config)
        self.kv_in, self.gdn_in = kv, gdn
        self.kv_out: KV = {}
        self.tail_out: dict[int, torch.Tensor] = {}
        self.state_out: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.kv_out[layer_idx] = (key_states, value_states)
        if layer_idx not in self.kv_in:
            return key_states, value_states
        k, v = self.kv_in[layer_idx]
        return torch.cat([k.to(key_states.dtype), key_states], -2), torch.cat([v.to(value_states.dtype),
                                                                              value_states], -2)

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.gdn_in[layer_idx][0] if layer_idx in self.gdn_in else None

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.gdn_in[layer_idx][1] if layer_idx in self.gdn_in else None

    def is_recording_past(self, layer_idx):
        return True  # never the in-place single-token conv update: a one-token window stays differentiable

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        tail = self.get_conv_state(layer_idx)
        full = conv_states if tail is None else torch.cat([tail.to(conv_states.dtype), conv_states], -1)
        keep = conv_kernel_size - 1  # zero history where the sequence so far is shorter, as the conv pads
        padded = F.pad(full, (max(0, keep - full.shape[-1]), 0))
        self.tail_out[layer_idx] = padded[..., padded.shape[-1] - keep:]
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self.state_out[layer_idx] = recurrent_states
        return recurrent_states


@dataclass
class Window:
    """One call: positions ``[start, end)`` of the standalone ``layout`` from the caches before ``start``; the loss
    of the targets read in ``[loss_from, end)`` over the example's target count ``n_targets``."""
    layout: PackLayout
    start: int
    end: int
    loss_from: int
    kv: KV
    gdn: GDN
    n_targets: int


@dataclass
class WindowOut:
    loss: torch.Tensor  # scalar: this window's share of the per-example mean loss
    kv: KV  # K/V of [start, end)
    gdn: GDN  # (conv tail, state) at end


def run_window(lm, win: Window) -> WindowOut:
    """Called by :meth:`PackedLM.forward` for a :class:`Window` (inside the FSDP root's hooks)."""
    from packtrain.packed.lm import _ce_dtype

    text_model, lm_head = text_parts(lm.model)
    lay, s, e = win.layout, win.start, win.end
    cache = WindowCache(text_model.config, win.kv, win.gdn)
    # Every query sees every cached position and its own window causally: an explicit mask, so neither
    # transformers' mask builder nor SDPA's is_causal guesses the offset.
    own = torch.ones(e - s, e - s, dtype=torch.bool, device=lay.input_ids.device).tril()
    mask = torch.cat([own.new_ones(e - s, s), own], dim=1)[None, None]
    body = dataclasses.replace(lay, input_ids=lay.input_ids[:, s:e], image_grid_thw=None, pixel_values=None,
                               _cache={})
    positions = packed_positions(lm.model, lay)[..., s:e]  # M-RoPE [4, 1, T] or 1-D [1, T] by family
    hidden = lm.run_body(body, cache=cache, use_cache=True, position_ids=positions,
                         attention_mask={"full_attention": mask, "linear_attention": None}).last_hidden_state
    pos = lay.target_positions
    chosen = ((pos >= win.loss_from) & (pos < e)).nonzero()[:, 0]
    logits = lm_head(hidden[0].index_select(0, pos[chosen] - s))
    loss = F.cross_entropy(logits.to(_ce_dtype(logits.dtype)), lay.target_ids[chosen], reduction="sum")
    gdn = {i: (cache.tail_out[i], cache.state_out[i]) for i in cache.state_out}
    return WindowOut(loss / win.n_targets, cache.kv_out, gdn)


# -- the walk ---------------------------------------------------------------------------------------------------
def _rng_state(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _replay(state, device: torch.device):
    """Draw the random numbers (LoRA dropout) a chunk drew in its no_grad forward again in its recompute, as
    torch.utils.checkpoint does, so the recomputed chunk is the one whose caches the later chunks read."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


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
        self.kv_all: KV = {}  # every position's K/V, filled as the forward goes
        self.total = 0.0

    def call(self, start, end, loss_from, kv: KV, gdn: GDN) -> WindowOut:
        return self.lm(Window(self.lay, start, end, loss_from, kv, gdn, self.n_targets))

    def dummy_call(self, grad: bool) -> None:
        """A call with the same collectives and nothing learned: position 0 alone, loss scaled by zero."""
        with torch.set_grad_enabled(grad):
            out = self.call(0, 1, 1, {}, {})
        if grad:
            (out.loss * 0.0).backward()

    def store_kv(self, out: WindowOut, start: int) -> None:
        for i, (k, v) in out.kv.items():
            if i not in self.kv_all:
                shape = lambda t: t.shape[:-2] + (self.end, t.shape[-1])
                self.kv_all[i] = (k.new_zeros(shape(k)), v.new_zeros(shape(v)))
            n = k.shape[-2]
            self.kv_all[i][0][..., start:start + n, :] = k.detach()
            self.kv_all[i][1][..., start:start + n, :] = v.detach()

    def kv_before(self, w: int, leaf: bool) -> KV:
        out = {}
        for i, (k, v) in self.kv_all.items():
            k, v = k[..., :w, :].detach(), v[..., :w, :].detach()
            out[i] = (k.requires_grad_(), v.requires_grad_()) if leaf else (k, v)
        return out

    def backward(self, out: WindowOut, grads_kv: KV | None, grads_gdn: GDN | None) -> None:
        """Backward of ``out.loss * scale`` plus the gradients later chunks left on the window's outputs."""
        tensors, grads = [out.loss * self.scale], [None]
        for i, (k, v) in out.kv.items():
            if grads_kv is not None:
                tensors += [k, v]
                grads += list(grads_kv[i])
        if grads_gdn is not None:
            for i, pair in out.gdn.items():
                tensors += list(pair)
                grads += list(grads_gdn[i])
        kept = [(t, g if g is not None else torch.ones_like(t)) for t, g in zip(tensors, grads) if t.requires_grad]
        torch.autograd.backward([t for t, _ in kept], [g for _, g in kept])

    # -- horizon all --------------------------------------------------------------------------------------------
    def exact(self, pad: Schedule) -> None:
        p, chunks = self.p, chunk_bounds(self.p, self.end, self.spec.chunk)
        if self.dummy:
            chunks = []
        with torch.set_grad_enabled(not self.frozen):  # P once; its graph kept for the end (full context)
            first = self.call(0, p, 0, {}, {}) if not self.dummy else self.call(0, 1, 1, {}, {})
        self.total += float(first.loss.detach())
        self.store_kv(first, 0)
        bounds = [{i: (t.detach(), s.detach()) for i, (t, s) in first.gdn.items()}]
        device, rng = self.lay.input_ids.device, []
        with torch.no_grad():
            for a, e in chunks:
                rng.append(_rng_state(device))
                out = self.call(a, e, e, self.kv_before(a, leaf=False), bounds[-1])
                self.store_kv(out, a)
                bounds.append(out.gdn)
        for _ in range(pad.forwards - len(chunks)):
            self.dummy_call(grad=False)
        g_kv = {i: (torch.zeros_like(k), torch.zeros_like(v)) for i, (k, v) in self.kv_all.items()}
        g_gdn = None
        for c in reversed(range(len(chunks))):
            a, e = chunks[c]
            kv_in = self.kv_before(a, leaf=True)
            gdn_in = {i: (t.clone().requires_grad_(), s.clone().requires_grad_()) for i, (t, s) in bounds[c].items()}
            with _replay(rng[c], device):
                out = self.call(a, e, a, kv_in, gdn_in)
            self.backward(out, {i: (gk[..., a:e, :], gv[..., a:e, :]) for i, (gk, gv) in g_kv.items()}, g_gdn)
            self.total += float(out.loss.detach())
            for i, (k, v) in kv_in.items():
                for acc, leaf in ((g_kv[i][0], k), (g_kv[i][1], v)):
                    if leaf.grad is not None:
                        acc[..., :a, :] += leaf.grad
            g_gdn = {i: tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in pair)
                     for i, pair in gdn_in.items()}
        for _ in range(pad.backwards - len(chunks)):
            self.dummy_call(grad=True)
        if not self.frozen:  # into P's graph: its own loss, the K/V every chunk read, the first chunk's state
            n = 1 if self.dummy else p
            self.backward(first, {i: (gk[..., :n, :], gv[..., :n, :]) for i, (gk, gv) in g_kv.items()}, g_gdn)

    # -- finite horizon -----------------------------------------------------------------------------------------
    def truncated(self, pad: Schedule, item_len: int) -> None:
        p, spec = self.p, self.spec
        length = self.end + 1 - p
        points = [] if self.dummy else cuts(p, item_len, length, spec, self.frozen)
        wins = [] if self.dummy else windows(p, item_len, length, spec, self.frozen)
        states: dict[int, GDN] = {0: {}}
        with torch.no_grad():  # losses counted here only where no window computes them: P's under frozen
            for s, e in itertools.pairwise(points):
                loss_from = 0 if (self.frozen and e <= p) else e
                out = self.call(s, e, loss_from, self.kv_before(s, leaf=False), states[s])
                self.total += float(out.loss.detach())
                self.store_kv(out, s)
                states[e] = out.gdn
        for _ in range(pad.forwards - max(len(points) - 1, 0)):
            self.dummy_call(grad=False)
        for w, a, e in wins:
            out = self.call(w, e, a, self.kv_before(w, leaf=False), states[w])
            self.backward(out, None, None)
            self.total += float(out.loss.detach())
        for _ in range(pad.backwards - len(wins)):
            self.dummy_call(grad=True)


def train_walk(lm, layout: PackLayout, spec: WalkSpec, scale: float, pad: Schedule,
               dummy: bool = False) -> WalkResult:
    """Forward and backward of one walked example (gradients accumulate into the parameters, scaled by
    ``scale``); ``pad`` is the schedule every rank issues in this slot (:func:`packtrain.data.walk_schedule.schedule`)."""
    if lm.context.mode == "kv_only":
        raise ValueError("packing.on_overflow=walk: packing.context_grad kv_only is not supported (full or frozen)")
    frozen = lm.context.mode == "frozen"
    walk = _Walk(lm, layout, spec, frozen, scale, dummy)
    if spec.horizon is None:
        walk.exact(pad)
    else:
        item_len = int(layout.target_positions[0]) + 1 - walk.p  # the first target is read at |P| + item - 1
        walk.truncated(pad, item_len)
    return WalkResult(walk.total, walk.n_targets)


@torch.no_grad()
def eval_walk(lm, layout: PackLayout, spec: WalkSpec, chunks: int, dummy: bool = False) -> WalkResult:
    """The example's loss, chunk by chunk under no_grad (``chunks``: the count every rank issues in this slot)."""
    walk = _Walk(lm, layout, spec, False, 0.0, dummy)
    bounds = [] if dummy else [(0, walk.p)] + chunk_bounds(walk.p, walk.end, spec.chunk)
    gdn: GDN = {}
    for s, e in bounds:
        out = walk.call(s, e, s, walk.kv_before(s, leaf=False), gdn)
        walk.total += float(out.loss)
        walk.store_kv(out, s)
        gdn = out.gdn
    for _ in range(chunks + 1 - len(bounds)):
        walk.dummy_call(grad=False)
    return WalkResult(walk.total, walk.n_targets)
