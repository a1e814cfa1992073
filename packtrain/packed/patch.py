"""The one place that teaches a transformers model of a supported family (:mod:`packtrain.packed.families`) to run a pack.

- Full-attention layers: transformers' registration point. ``packtrain_attention`` is registered as the
  attention implementation ``packtrain`` (with SDPA's mask builder) and set on the text config; calls that carry
  an object under ``LAYOUT_KWARG`` (a pack's :class:`~packtrain.packed.pack_pass.PackPass`: the shared-prefix
  predicate; decoding :class:`~packtrain.packed.rows.Rows`) have it run the layer, every other call goes to SDPA
  unchanged.
- Gated DeltaNet layers have no registration point, so each GDN instance (Qwen3.5/3.6, Qwen3-Next) gets a forward
  that has that object run the layer when one is passed (a pack: :func:`packtrain.packed.gdn.packed_gdn_forward`)
  and its original forward otherwise, with its family's projection split. The decoder layer passes its
  ``**kwargs`` (and so that object) to both. Which layer is which comes from the text config's ``layer_types``; a kind the family's row does not
  list is refused.

- Dense MLPs: each decoder layer's dense MLP runs in tiles of the back end's ``mlp_rows`` (``train.mlp_chunk_rows``)
  in every forward (packs, standalone examples, walk windows), with grad and without alike: the walk draws a
  chunk's dropout masks under no_grad and again with grad, so both must tile the same. With grad each tile is
  recomputed in backward (:func:`packtrain.packed.recompute.tiled_mlp`). A mixture of experts (routed experts and
  shared expert) runs as transformers wrote it.
- RMSNorms of the text stack (the q/k norms and GDN's gated norm among them) run in recomputed row tiles of the
  back end's ``norm_rows`` (``train.norm_chunk_rows``), keeping only their inputs for backward
  (:func:`packtrain.packed.recompute.tiled_norm`); without ``norm_rows``, as transformers wrote them.

Works on peft-wrapped models (LoRA layers are injected in place) and under activation checkpointing (the
recompute receives the same object through the same kwargs).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from packtrain.packed.attention import (
    ATTN_NAME,
    attention_batched,
    attention_dense,
    attention_flex,
    frozen_batched,
    frozen_dense,
    frozen_flex,
    packtrain_attention,
)
from packtrain.packed.families import FULL, LINEAR, UnsupportedModelError, check_layer_types, family_of, resolve
from packtrain.packed.gdn import conv_fla, conv_torch, delta_rule_fla, delta_rule_torch
from packtrain.packed.kernels import Backend
from packtrain.packed.kernels.hf_route import route_unpacked_kernels
from packtrain.packed.recompute import is_rmsnorm, tiled_mlp, tiled_norm
from packtrain.packed.tree import attention_by_node, fla_rule, torch_rule, tree_attention_dense, tree_attention_flex

# The keyword under which a packed forward passes what its patched layers read: a pack's
# packtrain.packed.pack_pass.PackPass, or a generation's decoding packtrain.packed.rows.Rows. Each patched layer
# calls the object's method for its kind (attention, gated_deltanet), so it never asks which of the two it has.
LAYOUT_KWARG = "packtrain_pack"

# Every unpacked forward packtrain runs goes through a model this module patches or imports: route transformers'
# unpacked GDN kernels on CPU to its torch fallbacks once, here (see packtrain/packed/kernels/hf_route.py).
route_unpacked_kernels()


def _register() -> None:
    AttentionInterface.register(ATTN_NAME, packtrain_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def text_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(text decoder stack, lm_head), where the model's row in :mod:`packtrain.packed.families` says they are."""
    family = family_of(model)
    base = unwrap(model)
    return resolve(base, family.stack), resolve(base, family.head)


def model_body(model: nn.Module) -> tuple[nn.Module, bool]:
    """(the module that runs embedding + (vision) + decoder stack, whether it is a vision-language model)."""
    family = family_of(model)
    return resolve(unwrap(model), family.body), family.vision


def packed_positions(model: nn.Module, layout):
    """The position ids a pack passes to the model: M-RoPE ``[4, 1, T]`` or row 0 (``[1, T]``) for 1-D RoPE."""
    return layout.position_ids if family_of(model).positions == "mrope" else layout.position_ids[0]


@dataclass(frozen=True)
class ModelParts:
    """Where a model's parts are, read once from its family's row (:class:`packtrain.packed.lm.PackedLM` keeps one)."""
    text_model: nn.Module  # the text decoder stack (embed_tokens, layers, norm)
    lm_head: nn.Module
    body: nn.Module  # what runs embedding + (vision) + decoder stack
    vision: bool  # a vision-language model
    mrope: bool  # M-RoPE positions [4, 1, T] (else 1-D, row 0)

    def positions(self, layout):
        """The position ids a pack passes to the model: M-RoPE ``[4, 1, T]`` or row 0 (``[1, T]``) for 1-D RoPE."""
        return layout.position_ids if self.mrope else layout.position_ids[0]


def model_parts(model: nn.Module) -> ModelParts:
    family = family_of(model)
    (text_model, lm_head), (body, vision) = text_parts(model), model_body(model)
    return ModelParts(text_model, lm_head, body, vision, family.positions == "mrope")


def vision_spec(model: nn.Module):
    """The image token id and spatial merge size of a vision-language model, None for a text model."""
    from packtrain.data.images import VisionSpec

    if not family_of(model).vision:
        return None
    base = unwrap(model)
    return VisionSpec(base.config.image_token_id, base.config.vision_config.spatial_merge_size)


def _gdn_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    pack = kwargs.pop(LAYOUT_KWARG, None)  # a pack's PackPass or decoding Rows: it runs the layer
    if pack is None:
        return self._packtrain_original_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    if cache is not None:
        raise ValueError("a packed forward cannot use a cache")
    return pack.gated_deltanet(self, hidden_states)


@dataclass(frozen=True)
class Kernels:
    """A back end's kernels, picked once from its names (:func:`pick_kernels`) and given to every patched layer,
    which calls them and never asks which back end it runs on."""
    backend: Backend
    attention: Callable  # a pack: (q, k, v, layout, scaling, dropout, prefix_outputs_grad) -> [1, H, T, D]
    frozen_attention: Callable  # continuations against P's keys from outside: (q, k, v, k_P, v_P, layout, ...)
    tree_attention: Callable  # a prefix tree: (q, k, v, tree layout, scaling, dropout)
    conv: Callable  # Gated DeltaNet's causal conv over a buffer: (module, conv_in, weight, layout)
    delta_rule: Callable  # its delta rule: (module, conv out, b, a, layout, P's state or None, states)
    tree_rule: Callable  # a tree level's varlen chunk rule (packtrain.packed.tree.tree_delta_rule)

    @property
    def mlp_rows(self) -> int | None:
        return self.backend.mlp_rows

    @property
    def norm_rows(self) -> int | None:
        return self.backend.norm_rows


# the back end's names -> its kernels: the one place they are read
ATTENTION_KERNELS = {"batched": (attention_batched, frozen_batched, attention_by_node),
                     "dense": (attention_dense, frozen_dense, tree_attention_dense),
                     "flex": (attention_flex, frozen_flex, tree_attention_flex)}
GDN_KERNELS = {"torch": (conv_torch, delta_rule_torch, torch_rule), "fla": (conv_fla, delta_rule_fla, fla_rule)}


def pick_kernels(backend: Backend) -> Kernels:
    return Kernels(backend, *ATTENTION_KERNELS[backend.attention], *GDN_KERNELS[backend.gdn])


def _mlp_forward(self, x):
    rows = self.packtrain_kernels.mlp_rows
    if not rows:
        return self._packtrain_original_forward(x)
    return tiled_mlp(self, self._packtrain_original_forward, x, rows)


def _norm_forward(self, *args):
    rows = self.packtrain_kernels.norm_rows
    if not rows:
        return type(self).forward(self, *args)  # looked up per call: a replacement on the class applies
    return tiled_norm(self, rows, self.packtrain_width, *args)


def _is_dense_mlp(module: nn.Module) -> bool:
    return hasattr(module, "down_proj") and not hasattr(module, "experts")


def _patch_forward(module: nn.Module, forward) -> None:
    if not hasattr(module, "_packtrain_original_forward"):
        module._packtrain_original_forward = module.forward
        module.forward = types.MethodType(forward, module)


def patch_model(model: nn.Module, backend: Backend) -> nn.Module:
    """Patch in place (idempotent; a second call only changes the back end). Returns the model."""
    family = family_of(model)
    text_model, _ = text_parts(model)
    layer_types = text_model.config.layer_types
    check_layer_types(family, layer_types, f"{family.model_type} layer_types")
    _register()
    text_model.config._attn_implementation = ATTN_NAME
    kernels = pick_kernels(backend)
    for layer, kind in zip(text_model.layers, layer_types):
        if _is_dense_mlp(getattr(layer, "mlp", None)):
            _patch_forward(layer.mlp, _mlp_forward)
            layer.mlp.packtrain_kernels = kernels
        if kind == LINEAR:
            gdn = layer.linear_attn
            _patch_forward(gdn, _gdn_forward)
            gdn.packtrain_split = family.gdn.split
            gdn.packtrain_kernels = kernels
        elif kind == FULL:
            layer.self_attn.packtrain_kernels = kernels
    for module in text_model.modules():
        if is_rmsnorm(module):
            _patch_forward(module, _norm_forward)
            module.packtrain_kernels = kernels
            module.packtrain_width = text_model.config.hidden_size
    text_model.packtrain_kernels = kernels
    return model


__all__ = ["LAYOUT_KWARG", "ModelParts", "UnsupportedModelError", "model_body", "model_parts", "packed_positions",
           "patch_model", "text_parts", "unwrap", "vision_spec"]
