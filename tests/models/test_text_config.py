"""A model's text config normalised (packtrain/models/text_config.py): Qwen3.5's and every family's defaults are
transformers' own, layer types included; each layer's kind (mixer, MLP) and the reduced model of one layer per kind
that `plan --measure` runs, by hand."""

from packtrain.config import config_from_dict
from packtrain.models.text_config import (
    FAMILY_DEFAULTS,
    TEXT_DEFAULTS,
    distinct_kinds,
    kind_name,
    reduced_config,
    text_config,
)


def test_text_defaults_are_transformers_defaults():
    from transformers import Qwen3_5TextConfig

    defaults = Qwen3_5TextConfig()
    for key, value in TEXT_DEFAULTS.items():
        assert getattr(defaults, key) == value, key
    assert text_config({})["layer_types"] == defaults.layer_types


def test_family_defaults_are_transformers_defaults():
    from transformers import AutoConfig

    for text_type, fields in FAMILY_DEFAULTS.items():
        defaults = AutoConfig.for_model(text_type)
        for key, value in fields.items():
            assert getattr(defaults, key) == value, (text_type, key)
        assert text_config({"model_type": text_type})["layer_types"] == defaults.layer_types, text_type


L, F = "linear_attention", "full_attention"
NEXT = {"model_type": "qwen3_next", "num_hidden_layers": 6, "layer_types": [L, L, F, L, L, F], "decoder_sparse_step": 2,
        "mlp_only_layers": [1, 4]}


def test_each_layer_s_kind_is_its_mixer_and_its_mlp():
    """Qwen3-Next's routed experts sit on every decoder_sparse_step-th layer (1-based) not in mlp_only_layers."""
    text = text_config(NEXT)
    assert text["kinds"] == [(L, "dense"), (L, "dense"), (F, "dense"), (L, "moe"), (L, "dense"), (F, "moe")]
    assert distinct_kinds(text) == [(L, "dense"), (F, "dense"), (L, "moe"), (F, "moe")]
    assert kind_name(text, text["kinds"][3]) == "linear_attention, moe"
    dense = text_config({"model_type": "qwen3_5_text", "num_hidden_layers": 2, "layer_types": [L, F]})
    assert dense["kinds"] == [(L, "dense"), (F, "dense")] and kind_name(dense, (F, "dense")) == F
    assert text_config({"model_type": "qwen3_next", "num_experts": 0})["kinds"][3] == (F, "dense")  # no experts


def test_the_reduced_model_has_one_layer_per_kind():
    cfg = config_from_dict({"model": {"config": NEXT}})
    assert reduced_config(cfg, copies=2) == {**NEXT, "num_hidden_layers": 8, "layer_types": [L, F, L, F] * 2,
                                             "mlp_only_layers": [0, 1, 4, 5], "decoder_sparse_step": 1}
    vlm = {"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 4, "layer_types": [L, L, F, L]}}
    assert reduced_config(config_from_dict({"model": {"config": vlm}})) == {
        "model_type": "qwen3_5", "text_config": {"num_hidden_layers": 2, "layer_types": [L, F]}}
