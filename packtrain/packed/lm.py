"""The FSDP root, :class:`PackedLM`, and the calls it runs: ``lm(call)`` is ``call.run(lm)``, typed by the call.

Every forward of packtrain's model is one call object through the root (so FSDP's hooks run around each):

==========================================================  =========================================================
call                                                        returns
==========================================================  =========================================================
:class:`PackCall`: a whole pack                             :class:`~packtrain.packed.loss.LossOutput`
:class:`StandaloneCall`: one example alone                  :class:`~packtrain.packed.loss.LossOutput`
:class:`~packtrain.packed.groups.GroupCall`: one group      :class:`~packtrain.packed.loss.LossOutput`
:class:`~packtrain.packed.prefix.PrefixCall`: P alone       :class:`~packtrain.packed.prefix.PrefixState`
:class:`~packtrain.packed.walk.Window`: a walk's window     :class:`~packtrain.packed.walk.WindowOut`
:class:`~packtrain.packed.decode.ItemsCall`: items on P     (first logits [B, V], :class:`~packtrain.packed.rows.Rows`)
:class:`~packtrain.packed.decode.DecodeCall`: one token     logits [B, V]
:class:`~packtrain.packed.tree.TreeCall`: a prefix tree     :class:`~packtrain.packed.loss.LossOutput` (a
                                                            PackCall with the tree's pass)
==========================================================  =========================================================

A pack's loss uses the target-only head: only the hidden states just before each target token go through
``lm_head``: a 144K-position pack at vocabulary 248,320 would need 71.5 GB of bf16 logits for the whole buffer;
those rows go through the head and the cross-entropy ``train.loss_chunk_rows`` at a time
(:func:`packtrain.packed.loss.target_losses`). The cross-entropy is averaged over each example's target tokens,
giving one loss per example; ``loss_sum`` adds those up. A caller that divides every ``loss_sum`` of an optimizer
step by the step's total number of examples (across packs, micro-steps and ranks) gets the mean of per-example
losses whatever the split, so the update does not depend on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import nn

from packtrain.packed import loss
from packtrain.packed.context import context_grad as context_mode
from packtrain.packed.layout import PackLayout
from packtrain.packed.loss import LossOutput, examples_loss
from packtrain.packed.pack_pass import PackPass
from packtrain.packed.patch import LAYOUT_KWARG, model_parts, unwrap
from packtrain.packed.tree import TreeLayout, TreePass

R_co = TypeVar("R_co", covariant=True)
R = TypeVar("R")


class Call(Protocol[R_co]):
    """One forward through the root: the call knows how it runs on ``lm`` (a :class:`PackedLM`) and what it returns."""

    def run(self, lm: PackedLM) -> R_co: ...


@dataclass
class PackCall:
    """A whole pack: its loss under ``packing.context_grad`` (:meth:`ContextGrad.hidden_states
    <packtrain.packed.context.ContextGrad.hidden_states>`)."""
    layout: PackLayout

    def run(self, lm: PackedLM) -> LossOutput:
        layout = self.layout
        device = lm.parts.text_model.embed_tokens.weight.device
        if layout.input_ids.device != device:
            layout = layout.to(device)
        return examples_loss(lm, layout, *self.hidden_states(lm, layout))

    def hidden_states(self, lm: PackedLM, layout: PackLayout):
        return lm.context.hidden_states(lm, layout)


class StandaloneCall(PackCall):
    """One example alone (a standalone layout, ``concat(P, C)``) through the model's own forward: its loss under
    the mode's reference semantics."""

    def hidden_states(self, lm: PackedLM, layout: PackLayout):
        return lm.context.standalone_hidden_states(lm, layout)


class TreeCall(PackCall):
    """A tree pack through the root (``lm(TreeCall(layout))``, :mod:`packtrain.packed.tree`): a :class:`PackCall`
    whose forward runs the tree's pass (:class:`~packtrain.packed.tree.TreePass`), under ``packing.context_grad:
    full`` only (:meth:`~packtrain.packed.context.ContextGrad.tree_hidden_states`)."""

    def hidden_states(self, lm, layout: TreeLayout):
        return lm.context.tree_hidden_states(lm, layout, TreePass(layout))


class PackedLM(nn.Module):
    """Wraps a (peft-wrapped) Qwen3.5 model; ``forward(call)`` runs a :class:`Call` and returns what it returns.

    A pack runs the patched model (see :mod:`packtrain.packed.patch`); one example alone runs the model's own
    unmodified forward on the one sequence. ``context_grad`` (``packing.context_grad``, chosen once
    here) decides what the gradient does with P in both (:mod:`packtrain.packed.context`); ``loss_chunk_rows``
    (``train.loss_chunk_rows``) how many target rows go through the head and the loss at a time. This module is the
    root FSDP shards, so the root's forward hooks run around the whole computation.
    """

    def __init__(self, model: nn.Module, context_grad: str = "full",
                 loss_chunk_rows: int = 0):
        super().__init__()
        self.model = model
        self.parts = model_parts(model)  # the decoder stack, head, body and positions, found once
        self.context = context_mode(context_grad)
        self.context.install(model)
        self.loss_chunk_rows = loss_chunk_rows
        # (hidden [M, D], target ids [M], constant rows [M] or None) -> per-token losses [M]; under FSDP2 run as the
        # head unit's forward (packtrain.models.wrap.wrap)
        self.target_losses = functools.partial(loss.target_losses, self.parts.lm_head, chunk_rows=loss_chunk_rows)
        self.calls = 0  # forward calls of this root: each runs FSDP's collectives (packtrain.run.units counts them)

    def describe_loss(self) -> str:
        return loss.describe(self.loss_chunk_rows)

    def hidden_states(self, layout: PackLayout, pack: PackPass | None = None) -> torch.Tensor:
        """The final hidden states [1, T, D] of the layout's buffer (the body's last output); ``pack``: as
        :meth:`run_body`."""
        return self.run_body(layout, pack).last_hidden_state

    def run_body(self, layout: PackLayout, pack: PackPass | None = None, **extra):
        """Embedding (+ vision) + decoder stack on the layout's buffer; ``extra`` goes to the body call. ``pack``:
        what the patched layers read of a pack (:mod:`packtrain.packed.pack_pass`); without it, the model's own
        forward on the layout's one sequence."""
        kwargs = {"use_cache": False}
        if pack is not None:
            # A dict mask skips transformers' mask builder, which would infer (wrong) sequence boundaries
            # from the shared-prefix position ids; the layout carries the real ones.
            kwargs.update({"position_ids": self.parts.positions(layout),
                           LAYOUT_KWARG: pack,
                           "attention_mask": {"full_attention": None, "linear_attention": None}})
        if layout.image_grid_thw is not None:
            if not self.parts.vision:
                raise ValueError("examples with images need a vision-language model (model_type qwen3_5 or "
                                 "qwen3_5_moe)")
            if layout.pixel_values is None:
                raise ValueError("a layout with images has no pixel values (load them with an ImageLoader)")
            # All images of the pack go through the vision encoder as one batch (per-image boundaries from
            # image_grid_thw); the model's own forward puts the merger's output into the image-token slots and,
            # for a standalone example, computes its M-RoPE positions itself.
            image_token = unwrap(self.model).config.image_token_id
            kwargs.update(pixel_values=layout.pixel_values, image_grid_thw=layout.image_grid_thw,
                          mm_token_type_ids=(layout.input_ids == image_token).int())
        kwargs.update(extra)
        return self.parts.body(input_ids=layout.input_ids, **kwargs)

    def forward(self, call: Call[R]) -> R:
        self.calls += 1
        return call.run(self)
