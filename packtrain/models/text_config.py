"""A model's text config, normalised: the fields the estimate and the measurement read, each family's defaults filled
in (tested equal to transformers'), the kind of every decoder layer (its mixer and its MLP), and the reduced model of
one layer per kind that ``plan --measure`` runs. Pure arithmetic on dicts; no torch."""

from __future__ import annotations

from packtrain.packed.families import FAMILIES, check_config_dict, config_dict

# Each family's text-config defaults for the fields used here (tested equal to transformers').
_GDN = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32}
_MOE = {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
FAMILY_DEFAULTS = {
    "qwen3_5_text": {"vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                     "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, **_GDN},
    "qwen3_5_moe_text": {"vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
                         "num_key_value_heads": 2, "head_dim": 256, **_GDN, **_MOE, "num_experts": 256,
                         "num_experts_per_tok": 8},
    "qwen3_next": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, **_GDN, **_MOE,
                   "num_experts": 512, "num_experts_per_tok": 10, "decoder_sparse_step": 1},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128},
}
TEXT_DEFAULTS = FAMILY_DEFAULTS["qwen3_5_text"]
FULL, LINEAR = "full_attention", "linear_attention"
DENSE, MOE = "dense", "moe"


config_dict_of = config_dict  # ``model.config``, or ``config.json`` under ``model.path``


def text_config(raw: dict) -> dict:
    """A config dict of a supported family (text, or vision-language with ``text_config``; without a model_type:
    Qwen3.5) -> the text fields, defaulted, with ``family`` (its row's model type) and ``kinds`` (per layer: mixer,
    MLP)."""
    family = check_config_dict(raw) if "model_type" in raw else FAMILIES["qwen3_5_text"]
    raw = family.text_config(raw)
    text_type = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(family.model_type,
                                                                                  family.model_type)
    given = {k: v for k, v in raw.items() if v is not None}
    text = {"tie_word_embeddings": False, "mlp_only_layers": [], "decoder_sparse_step": 1,
            **FAMILY_DEFAULTS[text_type], **given, "family": text_type}
    if "layer_types" not in given:
        every = 4 if family.gdn else 1  # full_attention_interval; Qwen3: all full attention
        text["layer_types"] = [FULL if (i + 1) % every == 0 else LINEAR for i in range(text["num_hidden_layers"])]
    text["kinds"] = [(t, MOE if routed(text, family, i) else DENSE) for i, t in enumerate(text["layer_types"])]
    return text


def kind_name(text: dict, kind) -> str:
    """A layer kind as the output names it: its mixer, and its MLP in a family with routed experts."""
    mixer, mlp = split_kind(kind)
    return f"{mixer}, {mlp}" if FAMILIES[text["family"]].moe else mixer


def distinct_kinds(text: dict) -> list[tuple[str, str]]:
    """The layer kinds of a text config, each once, in the order they first appear."""
    return list(dict.fromkeys(text["kinds"]))


def reduced_config(cfg, copies: int = 1) -> dict:
    """The config dict of ``cfg``'s model with one decoder layer of each kind (``plan --measure``), ``copies`` times
    over: the layer types in the order they first appear, and dense MLPs where the full model has them
    (``mlp_only_layers``)."""
    raw = dict(config_dict_of(cfg))
    family = check_config_dict(raw)
    kinds = distinct_kinds(text_config(raw)) * copies
    small = {"num_hidden_layers": len(kinds), "layer_types": [mixer for mixer, _ in kinds]}
    if family.moe:
        small.update(mlp_only_layers=[i for i, (_, mlp) in enumerate(kinds) if mlp == DENSE], decoder_sparse_step=1)
    if family.vision:
        raw["text_config"] = {**raw.get("text_config", {}), **small}
    else:
        raw.update(small)
    return raw


def routed(text: dict, family, i: int) -> bool:
    """Whether layer i has routed experts (Qwen3-Next: not in mlp_only_layers, every decoder_sparse_step-th)."""
    return (family.moe and text.get("num_experts", 0) > 0 and i not in text["mlp_only_layers"]
            and (i + 1) % text["decoder_sparse_step"] == 0)


def split_kind(kind) -> tuple[str, str]:
    """A layer kind: (mixer, MLP); a bare mixer name means a dense MLP."""
    return (kind, DENSE) if isinstance(kind, str) else tuple(kind)
