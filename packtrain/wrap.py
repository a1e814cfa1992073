"""The one place that wraps a model for training, always in this order:
LoRA -> model patch -> activation checkpointing (+ offload) -> FSDP.

Activation checkpointing goes through torch's own checkpoint wrapper per decoder layer (the path FSDP uses),
never transformers' gradient checkpointing: its recompute receives the same keyword arguments, so the pack
layout is rebuilt identically in backward.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from packtrain.model_patch import text_parts


def checkpoint_decoder_layers(model: nn.Module) -> nn.Module:
    """Checkpoint every decoder layer of the text stack (non-reentrant: frozen inputs still give adapter grads)."""
    text_model, _ = text_parts(model)
    layer_type = type(text_model.layers[0])
    apply_activation_checkpointing(
        text_model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, layer_type),
    )
    return model
