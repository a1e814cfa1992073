"""``packing.continuation_groups``: a pack's continuations in groups against one P graph, for when a pack's memory
is the limit.

One pack is G + 1 calls of :class:`packtrain.packed.lm.PackedLM` (the FSDP root, so its hooks run per call):

1. P alone (:class:`packtrain.packed.prefix.PrefixCall`), its graph kept: P's state
   (:class:`~packtrain.packed.prefix.PrefixState`: every attention layer's keys and values, every Gated DeltaNet
   layer's final state and conv tail, and P's final hidden state at its last row, which a continuation without an
   item reads its first target off).
2. Each group in turn: its continuations as a pack without P's rows (the frozen context's kernels,
   :func:`packtrain.packed.context.continuations_on`) that reads P from *leaf* copies of step 1's state; its loss's
   backward leaves the gradient on P's state in the leaves' ``.grad`` (summed over the groups) and frees the
   group's graph.
3. One backward through P's graph with those summed gradients (:func:`packtrain.packed.prefix.backward_through`).

The gradient is the one-group pack's (the chain rule taken in two parts; float rounding aside,
tests/packed/test_groups.py compares both with the standalone examples). What peak memory holds: P's graph, one group's
graph, and the gradients of P's state (K/V of every attention layer over P, one state and tail per GDN layer), instead
of P's graph and every continuation's.

Under ``packing.context_grad`` kv_only, step 1 cuts the gradient at P's rows of every decoder-layer input (all of
its rows), as the mode's standalone reference does; under frozen, step 1 runs under no_grad and step 3 is skipped.

Every pack runs exactly G groups, whatever its continuation count, so every rank issues the same calls (the equal-call
rule of :func:`packtrain.run.step.rank_units`): a pack with fewer continuations than G fills its last groups with a dummy group
(its first continuation, its loss scaled by zero).
"""

from __future__ import annotations

from dataclasses import dataclass

from packtrain.packed.context import continuations_on
from packtrain.packed.layout import PackLayout
from packtrain.packed.loss import LossOutput, examples_loss, require_grad
from packtrain.packed.prefix import PrefixCall, PrefixState, backward_through


@dataclass
class Groups:
    """A pack's continuations in groups: one layout per group (P and the group's continuations), and each
    group's weight (1, or 0 for a filler)."""
    layouts: list[PackLayout]
    weights: list[float]
    runs: list[list[int]] | None = None  # per group, the positions of its continuations in the pack's order

    @property
    def length(self) -> int:
        """The pack's positions: P once and every real continuation."""
        p = self.layouts[0].prefix_len
        return p + sum(lay.length - p for lay, w in zip(self.layouts, self.weights) if w)

    def to(self, device) -> Groups:
        return Groups([lay.to(device) for lay in self.layouts], self.weights, self.runs)


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


@dataclass
class GroupCall:
    """Call 2: one group's continuations, reading P from ``prefix``."""
    layout: PackLayout
    prefix: PrefixState

    def run(self, lm) -> LossOutput:
        """The group's loss, as a whole pack's (:class:`packtrain.packed.lm.PackCall`) with P's rows read from
        ``prefix``; under frozen the targets read off P's last row are constants."""
        constant = not lm.context.prefix_in_graph
        return examples_loss(lm, self.layout, *continuations_on(lm, self.layout, self.prefix, constant=constant))


def train_groups(lm, groups: Groups, scale: float, loss_of=None) -> tuple[float, list[float]]:
    """Forward and backward of one pack in groups (gradients accumulate into the parameters, scaled by ``scale``
    times each group's weight). ``loss_of(group, out)``: a group's loss from its output (None: ``out.loss_sum``).
    Returns (the sum of its examples' losses, the per-example losses of its real groups in the pack's order)."""
    return _run_groups(lm, groups, scale, loss_of)


def eval_groups(lm, groups: Groups) -> tuple[float, list[float]]:
    """The same losses without backward (under the caller's no_grad): P once, each group against its state."""
    return _run_groups(lm, groups, None)


def _run_groups(lm, groups: Groups, scale: float | None, loss_of=None) -> tuple[float, list[float]]:
    if any(lay.image_grid_thw is not None for lay in groups.layouts):
        raise ValueError("packing.continuation_groups > 1 takes text-only packs; this pack has images "
                         "(set packing.continuation_groups: 1)")
    grad = scale is not None and lm.context.prefix_in_graph
    prefix = lm(PrefixCall(groups.layouts[0]))
    leaves = prefix.leaves(grad) if scale is not None else prefix
    total, losses = 0.0, []
    for g, (layout, weight) in enumerate(zip(groups.layouts, groups.weights)):
        out = lm(GroupCall(layout, leaves))
        loss = out.loss_sum if loss_of is None else loss_of(g, out)
        if scale is not None:
            require_grad(loss)
            (loss * (scale * weight)).backward()
        total += weight * float(loss.detach())
        if weight:
            losses += out.per_example.tolist()
    if grad:  # into P's graph
        backward_through(lm, prefix, leaves.grads())
    return total, losses
