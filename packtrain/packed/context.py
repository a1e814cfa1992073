"""``packing.context_grad``: what the gradient does with the shared prefix P, one class per mode (:class:`Full`,
:class:`KvOnly`, :class:`Frozen`, each a :class:`ContextGrad`). Chosen once at setup (:func:`context_grad`, printed in
the run header) and applied to every forward by :class:`packtrain.packed.lm.PackedLM`; the modes' methods answer
every question about P's gradient (nothing else compares a mode's name).

- ``full``: the exact gradient through P; every continuation's gradient sums into P's activations.
- ``kv_only`` (stop-gradient through the context): the forward is unchanged (bitwise). In backward the gradient on
  P's rows of every decoder-layer input is cut (detached): the residual stream, the embedding output (layer 0's
  input) included.
  Within a layer, weights still learn from P's rows through what the continuations read of P in that layer:
  attention K/V (k_proj, v_proj, k_norm) and the Gated DeltaNet inputs that build P's final state and conv tail
  (in_proj_qkv, in_proj_a, in_proj_b, conv1d, A_log, dt_bias). The model keeps learning how to read P and stops
  learning how to represent it. (A continuation with no item reads its first target off P's last row: that row's
  final hidden state is not a decoder-layer input, so the last layer still learns from it, as the definition says.)
- ``frozen`` (context-frozen training): P runs once under no_grad (:class:`packtrain.packed.prefix.PrefixCall`);
  the continuations read P's attention K/V, final GDN state and conv tail from its
  :class:`~packtrain.packed.prefix.PrefixState` as constants. Nothing of P is kept for backward; the gradient flows
  only through continuation positions (a target read off P's last row counts in the loss and carries no gradient:
  its logit comes from the no_grad pass).

Standalone mode runs each mode's reference semantics on ``concat(P, C)`` with the model's own forward: kv_only as
the same cut in hooks on the decoder layers; frozen as transformers' cache path (P under no_grad with
``use_cache=True``, then C against that cache, made differentiable by :func:`_differentiable`). Packed mode runs the
same semantics on a pack, and skips work where an upstream gradient is exactly zero on P's rows (kv_only):
- P's causal self-attention runs under no_grad (its output's gradient is zero; the continuations' reads of P's
  K/V still carry gradient), in the torch back end's batched attention;
- the MLP, q_proj (queries and output gate), o_proj, in_proj_z and out_proj compute their backward on the
  continuation rows only (:mod:`packtrain.packed.rowsparse`: the same full-row forward, dW = dY[C]^T X[C],
  dX[C] = dY[C] W).
  In the last layer the kept rows start one earlier when a target is read off P's last row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from torch import nn

    from packtrain.packed.layout import PackLayout
    from packtrain.packed.pack_pass import ItemRecord
    from packtrain.packed.prefix import PrefixState

# Importing this module needs no torch: the planner's and the memory estimate's callers ask the modes too. What runs
# the model imports torch and the packed computation where it runs.

# Modules whose P rows get exactly zero upstream gradient under kv_only (their outputs feed only P's own rows).
ROW_SPARSE_MODULES = ("mlp", "self_attn.q_proj", "self_attn.o_proj", "linear_attn.in_proj_z", "linear_attn.out_proj")


# -- kv_only: row-sparse backward -------------------------------------------------------------------------------
class _LayerRows:
    """The kept-row start of the decoder layer running now (None: dense), set from what the layer receives under
    the layout kwarg (a pack's :class:`~packtrain.packed.pack_pass.PackPass`, decoding rows, or nothing), so a
    checkpoint's recompute sets it again from the same arguments."""

    def __init__(self, index: int):
        self.index = index
        self.start: int | None = None

    def pre_hook(self, module, args, kwargs):
        from packtrain.packed.patch import LAYOUT_KWARG

        pack = kwargs.get(LAYOUT_KWARG)
        self.start = None if pack is None else pack.grad_rows_from(self.index)


def _row_sparse_forward(module: nn.Module, rows: _LayerRows) -> None:
    import torch

    from packtrain.packed.rowsparse import rows_from

    original = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        with rows_from(rows.start):
            return original(*args, **kwargs)

    module.forward = forward


def install_row_sparse(model: nn.Module) -> None:
    """Idempotent; dormant unless a packed kv_only layout is running (then see the module docstring)."""
    from packtrain.packed.patch import text_parts

    text_model, _ = text_parts(model)
    for i, layer in enumerate(text_model.layers):
        layer = getattr(layer, "_checkpoint_wrapped_module", layer)
        if hasattr(layer, "_packtrain_rows"):
            continue
        layer._packtrain_rows = rows = _LayerRows(i)
        layer.register_forward_pre_hook(rows.pre_hook, with_kwargs=True)
        for path in ROW_SPARSE_MODULES:
            module = layer
            for part in path.split("."):
                module = getattr(module, part, None)
            if module is not None and hasattr(module, "experts"):
                # a mixture of experts runs its routed experts on gathered token subsets, whose rows are not
                # buffer rows: only its shared expert (every row, in order) takes the row-sparse backward
                module = getattr(module, "shared_expert", None)
            if module is not None:
                _row_sparse_forward(module, rows)


# -- frozen: transformers' cache path, differentiable ---------------------------------------------------------
def _assign_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
    self.recurrent_states[state_idx] = recurrent_states
    self.is_recurrent_states_initialized[state_idx] = True
    return recurrent_states


def _differentiable(cache) -> None:
    """transformers updates a linear-attention cache layer in place (``copy_``), which breaks backward through
    the continuation (the chunk rule saved the state it overwrites). Make its updates assignments:
    ``record_past`` does it for the conv state (and avoids the in-place single-token conv kernel), and the recurrent
    state's update is replaced on this cache instance. Attention layers already concatenate."""
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            layer.record_past = True
            layer.update_recurrent_state = types.MethodType(_assign_recurrent_state, layer)


def _continuation_view(layout: PackLayout) -> PackLayout:
    """The layout without P's rows: the buffer holds only the continuations (positions and ids as before)."""
    p = layout.prefix_len
    return dataclasses.replace(layout, input_ids=layout.input_ids[:, p:], position_ids=layout.position_ids[..., p:],
                               segment_ids=layout.segment_ids[p:], _cache={})


def keep_from(layout: PackLayout, n_layers: int) -> tuple[int, ...]:
    """kv_only: per decoder layer, the first row whose output can get gradient: P's rows of every layer's output
    feed only the next layer's input (cut) -- except the last layer's, whose row P-1 feeds the head when a
    continuation without an item reads its first target off P's last row."""
    p = layout.prefix_len
    last = p - 1 if bool((layout.target_positions < p).any()) else p
    return (p,) * (n_layers - 1) + (last,)


# -- the modes: one class each ---------------------------------------------------------------------------------
class ContextGrad:
    """One ``packing.context_grad`` mode: what every question about P's gradient is answered by (nothing else
    compares a mode's name). :meth:`hidden_states` runs the body of ``lm`` (a PackedLM) on a pack under it,
    :meth:`standalone_hidden_states` on one example alone (the mode's reference semantics); both return (final
    hidden states [1, T', D], the target positions into them, rows of the targets whose logits are constants or
    None)."""
    name: ClassVar[str]
    description: ClassVar[str]
    prefix_in_graph: ClassVar[bool] = True  # P's own computation gets gradient (frozen: P is a constant)
    walks: ClassVar[bool] = True  # packing.on_overflow: walk runs under it

    def describe(self) -> str:
        return self.description

    def install(self, model: nn.Module) -> None:
        """What the mode adds to the model once (kv_only: the row-sparse backward)."""

    def hidden_states(self, lm, layout: PackLayout):
        raise NotImplementedError

    def standalone_hidden_states(self, lm, layout: PackLayout):
        raise NotImplementedError

    def tree_hidden_states(self, lm, layout: PackLayout, tree_pass):
        """A prefix tree's pack (:class:`packtrain.packed.tree.TreeCall`): full only (packtrain/config/support.py
        refuses the rest before a run starts)."""
        raise AssertionError(f"packing.mode tree: packing.context_grad {self.name} is not built for prefix trees "
                             "(full only; the support table, packtrain/config/support.py, refuses it)")

    def prefix_pass(self, layers, p: int):
        """The context P alone runs in (:class:`packtrain.packed.prefix.PrefixCall`): with its graph, cut, or under
        no_grad."""
        return contextlib.nullcontext()

    def check_walk(self) -> None:
        """A walk (``packing.on_overflow: walk``) under a mode that does not run it: the support table
        (packtrain/config/support.py) refuses it before a run starts."""
        assert self.walks, f"packing.on_overflow=walk under packing.context_grad {self.name}: the support table refuses it"

    # -- what the memory and time estimates count (packtrain/memory/estimate.py, step_time.py, savings.py) --------
    def graph_rows(self, positions: int, prefix: int, group_positions: int | None) -> tuple[int, int]:
        """(the rows whose activations a unit's graph keeps, the rows one layer's recompute holds) for a unit of
        ``positions`` whose first ``prefix`` are P: every row; in continuation groups (``group_positions``: the
        largest group's continuation rows) P's and that group's, a layer's recompute the larger of the two."""
        if group_positions is None:
            return positions, positions
        return group_positions + prefix, max(prefix, group_positions)

    def estimate_note(self) -> str:
        """What an estimate's title says of the mode."""
        return f"; context_grad {self.name}"


class Full(ContextGrad):
    name = "full"
    description = "full (exact gradient through P)"

    def hidden_states(self, lm, layout):
        from packtrain.packed.pack_pass import PackPass

        return lm.hidden_states(layout, PackPass(layout)), layout.target_positions, None

    def standalone_hidden_states(self, lm, layout):
        return lm.hidden_states(layout), layout.target_positions, None

    def tree_hidden_states(self, lm, layout, tree_pass):
        return lm.hidden_states(layout, tree_pass), layout.target_positions, None

    def estimate_note(self):
        return ""  # the default mode goes unsaid


class KvOnly(ContextGrad):
    name = "kv_only"
    description = "kv_only (forward unchanged; gradient cut at P's rows of every decoder-layer input)"
    walks = False

    def install(self, model):
        install_row_sparse(model)

    def hidden_states(self, lm, layout):
        from packtrain.packed.cut import cut_at_layer_inputs
        from packtrain.packed.pack_pass import PackPass

        layers = lm.parts.text_model.layers
        with cut_at_layer_inputs(layers, layout.prefix_len):
            pack = PackPass(layout, keep_from=keep_from(layout, len(layers)))
            return lm.hidden_states(layout, pack), layout.target_positions, None

    def standalone_hidden_states(self, lm, layout):
        from packtrain.packed.cut import cut_at_layer_inputs

        with cut_at_layer_inputs(lm.parts.text_model.layers, layout.prefix_len):
            return lm.hidden_states(layout), layout.target_positions, None

    def prefix_pass(self, layers, p):
        from packtrain.packed.cut import cut_at_layer_inputs

        return cut_at_layer_inputs(layers, p)


class Frozen(ContextGrad):
    name = "frozen"
    description = ("frozen (P under no_grad once per pack; continuations read its K/V, GDN state and conv tail as "
                   "constants)")
    prefix_in_graph = False

    def hidden_states(self, lm, layout):
        from packtrain.packed.prefix import PrefixCall

        return continuations_on(lm, layout, PrefixCall(layout).run(lm), constant=True)

    def standalone_hidden_states(self, lm, layout):
        """The mode's reference semantics: transformers' own cache path on concat(P, C)."""
        import torch


        p = layout.prefix_len
        prefix = dataclasses.replace(layout, input_ids=layout.input_ids[:, :p], image_grid_thw=None,
                                     pixel_values=None, _cache={})
        with torch.no_grad():  # P through the model's own forward, keeping only its cache
            first = lm.run_body(prefix, use_cache=True)
        cache, last = first.cache, first.last_hidden_state[:, -1:]
        rest = _continuation_view(layout)
        _differentiable(cache)
        second = lm.run_body(rest, cache=cache, use_cache=True, position_ids=lm.parts.positions(rest))
        hidden = torch.cat([last, second.last_hidden_state], dim=1)
        return hidden, layout.target_positions - (p - 1), layout.target_positions < p

    def prefix_pass(self, layers, p):
        import torch

        return torch.no_grad()

    def graph_rows(self, positions, prefix, group_positions):
        """P runs once under no_grad: only the continuations' rows keep a graph."""
        rows = positions - prefix if group_positions is None else group_positions
        return rows, rows


CONTEXTS: dict[str, type[ContextGrad]] = {c.name: c for c in (Full, KvOnly, Frozen)}
MODES = tuple(CONTEXTS)


def context_grad(name: str) -> ContextGrad:
    """The mode named ``name`` (``packing.context_grad``)."""
    if name not in CONTEXTS:
        raise ValueError(f"packing.context_grad: unknown value {name!r} ({' | '.join(MODES)})")
    return CONTEXTS[name]()


def continuations_on(lm, layout: PackLayout, prefix: PrefixState, constant: bool, record: ItemRecord | None = None):
    """A pack's continuations alone against P's state from outside (``prefix``, a
    :class:`~packtrain.packed.prefix.PrefixCall`'s). Returns what :meth:`ContextGrad.hidden_states` returns:
    targets read off P's last row take ``prefix.last``, every other target t row t - P + 1; with ``constant`` those
    first ones are constants (frozen). ``record``: a generation's item pass, which keeps each continuation's own
    state. Under every mode the kernels read P from ``prefix`` alone (no kv_only kept rows: no P row is here)."""
    import torch

    from packtrain.packed.pack_pass import PackPass

    p = layout.prefix_len
    rest = _continuation_view(layout)
    second = lm.run_body(rest, PackPass(rest, prefix=prefix, record=record))
    hidden = torch.cat([prefix.last.to(second.last_hidden_state.dtype), second.last_hidden_state], dim=1)
    return hidden, layout.target_positions - (p - 1), (layout.target_positions < p) if constant else None
