"""Loss of a pack (or of one example alone) with the target-only head.

Only the hidden states just before each target token go through ``lm_head``: a 144K-position pack at vocabulary
248,320 would need 71.5 GB of bf16 logits for the whole buffer; those rows go through the head and the
cross-entropy ``train.loss_chunk_rows`` at a time (:func:`packtrain.packed.loss.target_losses`). The cross-entropy
is averaged over each example's target tokens, giving one loss per example; ``loss_sum`` adds those up. A caller
that divides every ``loss_sum`` of an optimizer step by the step's total number of examples (across packs,
micro-steps and ranks) gets the mean of per-example losses whatever the split, so the update does not depend on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from packtrain.config import TrainConfig
from packtrain.packed import loss
from packtrain.packed.context import ContextGrad
from packtrain.packed.decode import DecodeCall, ItemsCall, run_decode, run_items
from packtrain.packed.groups import GroupCall, group_hidden
from packtrain.packed.layout import PackLayout
from packtrain.packed.patch import LAYOUT_KWARG, model_body, packed_positions, text_parts, unwrap
from packtrain.packed.prefix import PrefixCall, run_prefix
from packtrain.packed.walk import Window, run_window


@dataclass
class LossOutput:
    loss_sum: torch.Tensor  # scalar: sum over examples of their mean target cross-entropy
    per_example: torch.Tensor  # [N] detached per-example losses
    target_tokens: torch.Tensor  # [N]

    @property
    def num_examples(self) -> int:
        return int(self.per_example.numel())


class PackedLM(nn.Module):
    """Wraps a (peft-wrapped) Qwen3.5 model; ``forward(layout)`` returns a :class:`LossOutput`.

    A packed layout runs the patched model (see :mod:`packtrain.packed.patch`); a standalone layout runs the
    model's own unmodified forward on the one sequence. ``context_grad`` (``packing.context_grad``, chosen once
    here) decides what the gradient does with P in both (:mod:`packtrain.packed.context`); ``loss_chunk_rows``
    (``train.loss_chunk_rows``) how many target rows go through the head and the loss at a time. This module is the
    root FSDP shards, so the root's forward hooks run around the whole computation.
    """

    def __init__(self, model: nn.Module, context_grad: str = "full",
                 loss_chunk_rows: int = TrainConfig.loss_chunk_rows):
        super().__init__()
        self.model = model
        _, lm_head = text_parts(model)  # fail early on an unsupported model
        self.context = ContextGrad(context_grad)
        self.context.install(model)
        self.loss_chunk_rows = loss_chunk_rows
        # (hidden [M, D], target ids [M], constant rows [M] or None) -> per-token losses [M]; under FSDP2 run as the
        # head unit's forward (packtrain.models.wrap.prepare)
        self.target_losses = functools.partial(loss.target_losses, lm_head, chunk_rows=loss_chunk_rows)
        self.calls = 0  # forward calls of this root: each runs FSDP's collectives (packtrain.run.units counts them)

    def describe_loss(self) -> str:
        return loss.describe(self.loss_chunk_rows)

    def hidden_states(self, layout: PackLayout) -> torch.Tensor:
        """The final hidden states [1, T, D] of the layout's buffer (the body's last output)."""
        return self.run_body(layout).last_hidden_state

    def run_body(self, layout: PackLayout, **extra):
        """Embedding (+ vision) + decoder stack on the layout's buffer; ``extra`` goes to the body call."""
        body, is_vlm = model_body(self.model)
        kwargs = {"use_cache": False}
        if layout.packed:
            # A dict mask skips transformers' mask builder, which would infer (wrong) sequence boundaries
            # from the shared-prefix position ids; the layout carries the real ones.
            kwargs.update({"position_ids": packed_positions(self.model, layout), LAYOUT_KWARG: layout,
                           "attention_mask": {"full_attention": None, "linear_attention": None}})
        if layout.image_grid_thw is not None:
            if not is_vlm:
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
        return body(input_ids=layout.input_ids, **kwargs)

    def forward(self, layout: PackLayout) -> LossOutput:
        self.calls += 1
        if isinstance(layout, Window):  # one window of a walked example (packtrain.packed.walk)
            return run_window(self, layout)
        if isinstance(layout, PrefixCall):  # P of a pack alone (continuation groups, generation)
            return run_prefix(self, layout)
        if isinstance(layout, ItemsCall):  # a generation's items against P's state (packtrain.packed.decode)
            return run_items(self, layout)
        if isinstance(layout, DecodeCall):  # one token per decoding row
            return run_decode(self, layout)
        text_model, _ = text_parts(self.model)
        if isinstance(layout, GroupCall):  # one group of that pack's continuations
            call, layout = layout, layout.layout
            hidden, positions, constant = group_hidden(self, call)
        else:
            device = text_model.embed_tokens.weight.device
            if layout.input_ids.device != device:
                layout = layout.to(device)
            hidden, positions, constant = self.context.hidden_states(self, layout)
        token_loss = self.target_losses(hidden[0].index_select(0, positions), layout.target_ids, constant=constant)
        n = layout.num_examples
        counts = layout.target_counts.to(token_loss.dtype)
        per_example = token_loss.new_zeros(n).index_add(0, layout.target_example, token_loss) / counts
        loss_sum = per_example.sum()
        if constant is not None and torch.is_grad_enabled() and not loss_sum.requires_grad:
            # frozen, every target read off P's last row: nothing to learn, but the backward must still run (zero
            # gradients) so that every rank makes the same FSDP calls and the trainer's step goes on
            loss_sum = loss_sum + 0.0 * hidden[0, 1:].sum()
        return LossOutput(loss_sum=loss_sum, per_example=per_example.detach(), target_tokens=layout.target_counts)
