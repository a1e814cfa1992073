"""The one place that teaches a transformers Qwen3.5/3.6 model to run a pack.

- Full-attention layers: transformers' registration point. ``packtrain_attention`` is registered as the
  attention implementation ``packtrain`` (with SDPA's mask builder) and set on the text config; calls that carry
  a pack layout get the shared-prefix predicate, every other call goes to SDPA unchanged.
- Gated DeltaNet layers have no registration point, so each ``Qwen3_5GatedDeltaNet`` instance gets a forward
  that runs :func:`packtrain.gdn.packed_gdn_forward` when a pack layout is passed and its original forward
  otherwise. The decoder layer passes its ``**kwargs`` (and so the layout) to both.

Works on peft-wrapped models (LoRA layers are injected in place) and under activation checkpointing (the
recompute receives the same layout through the same kwargs).
"""

from __future__ import annotations

import types

from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from packtrain.attention import ATTN_NAME, packtrain_attention
from packtrain.gdn import packed_gdn_forward
from packtrain.kernels import Backend
from packtrain.kernels.hf_route import route_unpacked_kernels

LAYOUT_KWARG = "packtrain_pack"

# Every unpacked forward packtrain runs goes through a model this module patches or imports: route transformers'
# unpacked GDN kernels on CPU to its torch fallbacks once, here (see packtrain/kernels/hf_route.py).
route_unpacked_kernels()


class UnsupportedModelError(ValueError):
    pass


def _register() -> None:
    AttentionInterface.register(ATTN_NAME, packtrain_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def text_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(text decoder stack, lm_head) of a Qwen3_5ForCausalLM or Qwen3_5ForConditionalGeneration."""
    base = unwrap(model)
    name = type(base).__name__
    if name == "Qwen3_5ForCausalLM":
        return base.model, base.lm_head
    if name == "Qwen3_5ForConditionalGeneration":
        return base.model.language_model, base.lm_head
    raise UnsupportedModelError(
        f"packtrain supports Qwen3_5ForCausalLM and Qwen3_5ForConditionalGeneration (Qwen3.5/3.6); got {name}")


def model_body(model: nn.Module) -> tuple[nn.Module, bool]:
    """(the module that runs embedding + (vision) + decoder stack, whether it is the vision-language model)."""
    base = unwrap(model)
    text_parts(model)
    return base.model, type(base).__name__ == "Qwen3_5ForConditionalGeneration"


def vision_spec(model: nn.Module):
    """The image token id and spatial merge size of a vision-language model, None for a text model."""
    from packtrain.vision import VisionSpec

    base = unwrap(model)
    if type(base).__name__ != "Qwen3_5ForConditionalGeneration":
        return None
    return VisionSpec(base.config.image_token_id, base.config.vision_config.spatial_merge_size)


def _gdn_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    layout = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        return self._packtrain_original_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    if cache is not None:
        raise ValueError("a packed forward cannot use a cache")
    return packed_gdn_forward(self, hidden_states, layout, self.packtrain_backend)


def patch_model(model: nn.Module, backend: Backend) -> nn.Module:
    """Patch in place (idempotent; a second call only changes the back end). Returns the model."""
    text_model, _ = text_parts(model)
    _register()
    text_model.config._attn_implementation = ATTN_NAME
    found = {"full_attention": 0, "linear_attention": 0}
    for layer in text_model.layers:
        kind = getattr(layer, "block_type", None)
        if kind == "linear_attention":
            gdn = layer.linear_attn
            if not hasattr(gdn, "_packtrain_original_forward"):
                gdn._packtrain_original_forward = gdn.forward
                gdn.forward = types.MethodType(_gdn_forward, gdn)
            gdn.packtrain_backend = backend
        elif kind == "full_attention":
            layer.self_attn.packtrain_backend = backend
        else:
            raise UnsupportedModelError(f"unsupported decoder layer type {kind!r} in {type(layer).__name__}")
        found[kind] += 1
    text_model.packtrain_backend = backend
    return model
