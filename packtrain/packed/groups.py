"""``packing.continuation_groups``: a pack's continuations in groups against one P graph, for when a pack's memory
is the limit.

One pack is G + 1 calls of :class:`packtrain.packed.lm.PackedLM` (the FSDP root, so its hooks run per call):

1. P alone through the model's own forward with a :class:`packtrain.packed.walk.WindowCache`, its graph kept. The cache
   records what the continuations read of P: every attention layer's keys and values (after k_norm and RoPE),
   every Gated DeltaNet layer's final state and conv tail (its last W-1 pre-conv inputs); and P's final hidden
   state at its last row, which a continuation without an item reads its first target off.
2. Each group in turn: its continuations as a pack without P's rows (the frozen context's kernels,
   :func:`packtrain.packed.context.continuations_on`) that reads P from *leaf* copies of step 1's outputs; its loss's
   backward leaves the gradient on P's outputs in the leaves' ``.grad`` (summed over the groups) and frees the
   group's graph.
3. One backward through P's graph with those summed gradients.

The gradient is the one-group pack's (the chain rule taken in two parts; float rounding aside, tests/test_groups.py
compares both with the standalone examples). What peak memory holds: P's graph, one group's graph, and the
gradients of P's outputs (K/V of every attention layer over P, one state and tail per GDN layer), instead of P's
graph and every continuation's.

Under ``packing.context_grad`` kv_only, step 1 cuts the gradient at P's rows of every decoder-layer input (all of
its rows), as the mode's standalone reference does; under frozen, step 1 runs under no_grad (the frozen context's
own P pass) and step 3 is skipped.

Every pack runs exactly G groups, whatever its continuation count, so every rank issues the same calls: a pack with
fewer continuations than G fills its last groups with its first continuation, its loss scaled by zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from packtrain.packed.context import continuations_on, cut_at_layer_inputs
from packtrain.packed.layout import PackLayout
from packtrain.packed.patch import packed_positions, text_parts
from packtrain.packed.walk import GDN, KV, WindowCache


@dataclass
class Groups:
    """A pack's continuations in groups: one layout per group (P and the group's continuations), and each
    group's weight (1, or 0 for a filler)."""
    layouts: list[PackLayout]
    weights: list[float]

    @property
    def length(self) -> int:
        """The pack's positions: P once and every real continuation."""
        p = self.layouts[0].prefix_len
        return p + sum(lay.length - p for lay, w in zip(self.layouts, self.weights) if w)

    def to(self, device) -> Groups:
        return Groups([lay.to(device) for lay in self.layouts], self.weights)


def split(lengths: list[int], n_groups: int) -> list[list[int]]:
    """Indices 0..len-1 in ``n_groups`` runs in order, balanced by length: run g ends before the index that would
    take the running total past g / n_groups of the whole, takes at least one index, and leaves one for every
    later run while there are enough. Runs past the last index are empty."""
    total, runs, start, acc, n = sum(lengths), [], 0, 0, len(lengths)
    for g in range(1, n_groups + 1):
        end = start
        while end < n and (end == start or (acc + lengths[end] <= total * g / n_groups
                                            and n - end > n_groups - g)):
            acc += lengths[end]
            end += 1
        if g == n_groups:
            end = len(lengths)
        runs.append(list(range(start, end)))
        start = end
    return runs


def group_units(unit, lengths: list[int], n_groups: int) -> tuple[list, list[float]]:
    """``unit`` (a pack, :class:`packtrain.run.steps.Unit`) as ``n_groups`` units of its examples, and their weights."""
    runs = split(lengths, n_groups)
    units = [dataclasses.replace(unit, examples=tuple(unit.examples[i] for i in run or [0])) for run in runs]
    return units, [1.0 if run else 0.0 for run in runs]


@dataclass
class PrefixCall:
    """Call 1: P of ``layout`` (any of the pack's group layouts: they share P)."""
    layout: PackLayout


@dataclass
class PrefixOut:
    kv: KV  # attention layer -> (keys, values) [1, G, P, D]
    gdn: GDN  # GDN layer -> (conv tail [1, C, W-1], final state [1, HV, K, V])
    last: torch.Tensor  # [1, 1, D] P's final hidden state at its last row

    def tensors(self) -> list[torch.Tensor]:
        return [t for pair in (*self.kv.values(), *self.gdn.values()) for t in pair] + [self.last]

    def leaves(self, grad: bool) -> PrefixOut:
        """Detached copies (sharing storage) that collect the groups' gradients when ``grad``."""
        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().requires_grad_(grad)

        return PrefixOut({i: (leaf(k), leaf(v)) for i, (k, v) in self.kv.items()},
                         {i: (leaf(c), leaf(s)) for i, (c, s) in self.gdn.items()}, leaf(self.last))

    # the interface the packed kernels read P's caches through (packtrain.packed.context.PrefixCache)
    def kv_of(self, layer_idx: int):
        return self.kv[layer_idx]

    def gdn_of(self, layer_idx: int, width: int):
        tail, state = self.gdn[layer_idx]
        return tail[0, :, tail.shape[-1] - (width - 1):].T, state


class _Reader:
    """:class:`PrefixOut` as :class:`packtrain.packed.context.PrefixCache`'s interface (``kv``, ``gdn``)."""

    def __init__(self, prefix: PrefixOut):
        self.kv, self.gdn = prefix.kv_of, prefix.gdn_of


@dataclass
class GroupCall:
    """Call 2: one group's continuations, reading P from ``prefix``."""
    layout: PackLayout
    prefix: PrefixOut


def run_prefix(lm, call: PrefixCall) -> PrefixOut:
    """Called by :meth:`PackedLM.forward` for a :class:`PrefixCall`."""
    lay, mode = call.layout, lm.context.mode
    p = lay.prefix_len
    text_model, _ = text_parts(lm.model)
    cache = WindowCache(text_model.config, {}, {})
    body = dataclasses.replace(lay, packed=False, input_ids=lay.input_ids[:, :p], image_grid_thw=None,
                               pixel_values=None, _cache={})
    cut = cut_at_layer_inputs(text_model.layers, p) if mode == "kv_only" else contextlib.nullcontext()
    with cut, torch.set_grad_enabled(torch.is_grad_enabled() and mode != "frozen"):
        hidden = lm.run_body(body, cache=cache, use_cache=True, position_ids=packed_positions(lm.model, lay)[..., :p],
                             attention_mask={"full_attention": None, "linear_attention": None}).last_hidden_state
    gdn = {i: (cache.tail_out[i], cache.state_out[i]) for i in cache.state_out}
    return PrefixOut(cache.kv_out, gdn, hidden[:, -1:])


def group_hidden(lm, call: GroupCall):
    """:meth:`packtrain.packed.context.ContextGrad.hidden_states` for a :class:`GroupCall`."""
    frozen = lm.context.mode == "frozen"
    return continuations_on(lm, call.layout, _Reader(call.prefix), call.prefix.last, constant=frozen)


def train_groups(lm, groups: Groups, scale: float) -> float:
    """Forward and backward of one pack in groups (gradients accumulate into the parameters, scaled by
    ``scale``). Returns the sum of its examples' losses."""
    if any(lay.image_grid_thw is not None for lay in groups.layouts):
        raise ValueError("packing.continuation_groups > 1 takes text-only packs; this pack has images "
                         "(set packing.continuation_groups: 1)")
    grad = lm.context.mode != "frozen"
    prefix = lm(PrefixCall(groups.layouts[0]))
    leaves = prefix.leaves(grad)
    total = 0.0
    for layout, weight in zip(groups.layouts, groups.weights):
        out = lm(GroupCall(layout, leaves))
        (out.loss_sum * (scale * weight)).backward()
        total += weight * float(out.per_example.sum())
    if grad:  # into P's graph
        pairs = [(t, leaf.grad) for t, leaf in zip(prefix.tensors(), leaves.tensors())
                 if t.requires_grad and leaf.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    return total
