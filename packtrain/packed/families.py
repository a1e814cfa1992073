"""The model families packtrain trains: one row each, and everything the other modules ask about a model.

A row says which transformers class a ``model_type`` builds, where its text decoder stack, its body (the module
whose forward runs embedding, vision and stack) and its head are, which decoder layer kinds it has, how the
projections of its Gated DeltaNet layers split into the pre-conv q|k|v, z, b and a, which positions its rotary
embedding takes, and whether it has routed experts. Any other model type, or a layer kind a row does not list, is
refused before anything is built. Adding a family is adding a row (and, for a new GDN projection layout, a
:class:`GdnProjections`).

What the families share, and why one packed path serves them all: full attention goes through the registered
attention implementation and Gated DeltaNet through :mod:`packtrain.packed.gdn`; everything else in a decoder layer
(norms, dense MLP, MoE router and experts, shared expert) works token by token, so a pack computes exactly what
each example computes alone. Positions: Qwen3.5/3.6 take M-RoPE ``[4, 1, T]`` (row 0 the text position);
Qwen3-Next and Qwen3 take 1-D ``[1, T]``, which is row 0 of the same layout.

Torch-free at import (planning reads the table); the split functions import torch when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

FULL, LINEAR = "full_attention", "linear_attention"


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class GdnProjections:
    """How a GDN layer's input projections split. ``split(module, x_TD)`` -> (pre-conv q|k|v [T, 2K+V], z
    [T, HV, Dv], b [T, HV], a [T, HV]), through each projection's own call (LoRA, FSDP hooks); ``widths(text)``
    -> projection name -> output width, from a text config dict (for memory planning)."""

    split: Callable
    widths: Callable[[dict], dict[str, int]]


def _dims(text: dict) -> tuple[int, int, int]:
    key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    return key, value, text["linear_num_value_heads"]


def _split_separate(module, x_TD):
    T = x_TD.shape[0]
    z = module.in_proj_z(x_TD).reshape(T, -1, module.head_v_dim)
    return module.in_proj_qkv(x_TD), z, module.in_proj_b(x_TD), module.in_proj_a(x_TD)


def _split_fused(module, x_TD):
    """Qwen3-Next: q, k, v, z interleaved per key-head group in ``in_proj_qkvz`` (b, a likewise in ``in_proj_ba``);
    the module's own ``fix_query_key_value_ordering`` undoes that, then q|k|v are concatenated as its forward does."""
    import torch

    x_1TD = x_TD[None]
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x_1TD), module.in_proj_ba(x_1TD))
    T = x_TD.shape[0]
    return torch.cat([t.reshape(T, -1) for t in (q[0], k[0], v[0])], dim=-1), z[0], b[0], a[0]


SEPARATE = GdnProjections(  # Qwen3.5 / 3.6: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    split=_split_separate,
    widths=lambda t: dict(zip(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                              (2 * _dims(t)[0] + _dims(t)[1], _dims(t)[1], _dims(t)[2], _dims(t)[2]))),
)
FUSED = GdnProjections(  # Qwen3-Next: in_proj_qkvz, in_proj_ba
    split=_split_fused,
    widths=lambda t: {"in_proj_qkvz": 2 * _dims(t)[0] + 2 * _dims(t)[1], "in_proj_ba": 2 * _dims(t)[2]},
)


@dataclass(frozen=True)
class Family:
    model_type: str
    class_name: str  # the transformers class built for this model_type
    stack: str  # dotted path from the model to the text decoder stack (embed_tokens, layers, norm)
    body: str  # dotted path to the module whose forward runs embedding (+ vision) + stack
    head: str  # dotted path to the output projection
    layer_kinds: tuple[str, ...]  # the `layer_types` entries it has
    gdn: GdnProjections | None  # None: no Gated DeltaNet layers
    positions: Literal["mrope", "1d"]
    attention_gate: bool  # q_proj is twice as wide (an output gate on attention)
    vision: bool = False  # a vision-language model (image_token_id, vision_config in its config)
    moe: bool = False  # routed experts (mlp.experts, a frozen router mlp.gate); see docs/families.md

    def text_config(self, raw: dict) -> dict:
        """The text part of a config dict of this family."""
        return (raw.get("text_config") or {}) if self.vision else raw


_QWEN35 = dict(layer_kinds=(LINEAR, FULL), gdn=SEPARATE, positions="mrope", attention_gate=True)
FAMILIES = {f.model_type: f for f in [
    Family("qwen3_5_text", "Qwen3_5ForCausalLM", "model", "model", "lm_head", **_QWEN35),
    Family("qwen3_5", "Qwen3_5ForConditionalGeneration", "model.language_model", "model", "lm_head", vision=True,
           **_QWEN35),
    Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "model", "model", "lm_head", moe=True, **_QWEN35),
    Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "model.language_model", "model", "lm_head",
           vision=True, moe=True, **_QWEN35),
    Family("qwen3_next", "Qwen3NextForCausalLM", "model", "model", "lm_head", layer_kinds=(LINEAR, FULL), gdn=FUSED,
           positions="1d", attention_gate=True, moe=True),
    Family("qwen3", "Qwen3ForCausalLM", "model", "model", "lm_head", layer_kinds=(FULL,), gdn=None, positions="1d",
           attention_gate=False),
]}
_BY_CLASS = {f.class_name: f for f in FAMILIES.values()}
ROUTER = "mlp.gate"  # the MoE router inside a decoder layer: never trained


def supported() -> str:
    return ", ".join(FAMILIES)


def family_for_type(model_type, where: str = "model.config.model_type") -> Family:
    if model_type not in FAMILIES:
        raise UnsupportedModelError(f"{where}: {model_type!r} is not a model family packtrain supports "
                                    f"(supported: {supported()})")
    return FAMILIES[model_type]


def family_of(model) -> Family:
    """The row of a (peft-wrapped or plain) transformers model, by its class."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    name = type(base).__name__
    if name not in _BY_CLASS:
        raise UnsupportedModelError(f"packtrain does not support {name} (supported model types: {supported()})")
    return _BY_CLASS[name]


def check_layer_types(family: Family, layer_types, where: str) -> None:
    """Refuse a decoder layer kind the family's row does not list (e.g. a sliding-window or sparse layer)."""
    for i, kind in enumerate(layer_types or ()):
        if kind not in family.layer_kinds:
            raise UnsupportedModelError(
                f"{where}[{i}]: decoder layer type {kind!r} is not supported for {family.model_type} "
                f"(supported: {', '.join(family.layer_kinds)}; model types: {supported()})")


def check_config_dict(raw: dict, where: str = "model.config") -> Family:
    """The family of a transformers config dict (``model.config`` or a model directory's config.json); refuses an
    unknown model type or layer type with one line naming it."""
    if "model_type" not in raw:
        raise UnsupportedModelError(f"{where}.model_type: missing (one of {supported()})")
    family = family_for_type(raw["model_type"], f"{where}.model_type")
    text = family.text_config(raw)
    prefix = f"{where}.text_config" if family.vision else where
    check_layer_types(family, text.get("layer_types"), f"{prefix}.layer_types")
    return family


def check_built_config(family: Family, hf_config, where: str = "model.config") -> None:
    """The layer types a transformers config derived itself (e.g. Qwen3's sliding-window layers from
    ``use_sliding_window``), checked like explicit ones."""
    text = hf_config.get_text_config()
    check_layer_types(family, getattr(text, "layer_types", None), f"{where} (derived) layer_types")


def config_dict(cfg) -> dict:
    """``model.config``, or ``config.json`` under ``model.path`` (read without transformers)."""
    from packtrain.config.typed import read_json_object

    if cfg.model.config is not None:
        return dict(cfg.model.config)
    if cfg.model.path is None:
        raise ValueError("model: set model.path (a local model directory) or model.config (a config dict)")
    path = cfg.resolve_path(cfg.model.path) / "config.json"
    if not path.is_file():
        raise ValueError(f"model.path: {path.parent} is not a local transformers model directory (no config.json)")
    return read_json_object(path, "model.path")


def check_model(cfg) -> Family:
    """The family of ``cfg``'s model, refused at start (before data is read or a model built) if unsupported."""
    where = "model.config" if cfg.model.config is not None else f"{cfg.resolve_path(cfg.model.path)}/config.json"
    return check_config_dict(config_dict(cfg), where)


def describe(model) -> str:
    """One header line: family, class, layer kinds, routed experts."""
    family = family_of(model)
    get_base = getattr(model, "get_base_model", None)
    text = (get_base() if callable(get_base) else model).config.get_text_config()
    kinds = ", ".join(f"{text.layer_types.count(k)} {k}" for k in family.layer_kinds)
    experts = (f"; {text.num_experts} experts, {text.num_experts_per_tok} per token, router frozen"
               if family.moe else "")
    line = f"model: {family.model_type} ({family.class_name}: {kinds}{experts})"
    peft_config = getattr(model, "peft_config", {}).get("default")
    if peft_config is not None:  # what peft adapts, after any renaming of its own
        line += f"; LoRA on {', '.join(sorted(peft_config.target_modules or ()))}"
        if peft_config.target_parameters:
            line += f" and parameters {', '.join(sorted(peft_config.target_parameters))}"
    return line


def resolve(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
