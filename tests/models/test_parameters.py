"""Parameter counts from a text config (packtrain/models/parameters.py) against the models transformers builds (the
shipped configs, every family) and the adapters peft makes (projections, the routed experts' stacks, the head, the
copies of modules_to_save)."""

import pytest
import torch
from cli_helpers import REPO, TINY_MODEL

from packtrain.config import config_from_dict, load_config
from packtrain.models.parameters import lora_parameters, model_parameters
from packtrain.models.text_config import text_config


@pytest.mark.parametrize("name,billions", [("qwen3.6-27b", 26.9), ("qwen3.6-35b-a3b", 34.7)])
def test_parameters_match_transformers_for_the_shipped_configs(name, billions):
    from transformers import AutoConfig

    from packtrain.models.build import model_class_for

    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    raw = dict(cfg.model.config)
    model_type = raw.pop("model_type")
    with torch.device("meta"):
        model = model_class_for(model_type)(AutoConfig.for_model(model_type, **raw))
    n = sum(p.numel() for p in model.parameters())
    assert model_parameters(text_config(cfg.model.config)) == n
    assert n / 1e9 == pytest.approx(billions, abs=0.05)


@pytest.mark.parametrize("targets", [["gate_proj"], ["q_proj", "gate_proj", "up_proj", "down_proj"]])
def test_lora_parameters_match_peft(targets):
    from packtrain.models.build import apply_lora, build_base_model

    cfg = config_from_dict({"model": {"config": TINY_MODEL}, "lora": {"r": 4, "target_modules": targets}})
    model = apply_lora(build_base_model(cfg), cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_parameters(text_config(TINY_MODEL), 4, targets) == trainable


NEXT_TINY = {"model_type": "qwen3_next", "vocab_size": 97, "hidden_size": 24, "intermediate_size": 40,
             "num_hidden_layers": 5, "layer_types": ["linear_attention"] * 3 + ["full_attention"] * 2,
             "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8, "linear_num_key_heads": 2,
             "linear_num_value_heads": 6, "linear_key_head_dim": 4, "linear_value_head_dim": 6,
             "decoder_sparse_step": 2, "mlp_only_layers": [3], "moe_intermediate_size": 12,
             "shared_expert_intermediate_size": 20, "num_experts": 5, "num_experts_per_tok": 3,
             "tie_word_embeddings": True}
MOE_TINY = {**{k: v for k, v in NEXT_TINY.items() if k not in ("intermediate_size", "decoder_sparse_step",
                                                               "mlp_only_layers")}, "model_type": "qwen3_5_moe_text"}
QWEN3_TINY = {"model_type": "qwen3", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 40,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8}


@pytest.mark.parametrize("raw", [NEXT_TINY, MOE_TINY, QWEN3_TINY, {"model_type": "qwen3_5_moe",
                                                                   "text_config": MOE_TINY}], ids=lambda r: r["model_type"])
def test_family_parameters_match_transformers(raw):
    from transformers import AutoConfig

    from packtrain.models.build import model_class_for
    from packtrain.packed.families import FAMILIES

    family = FAMILIES[raw["model_type"]]
    kw = {k: v for k, v in raw.items() if k != "model_type"}
    with torch.device("meta"):
        model = model_class_for(raw["model_type"])(AutoConfig.for_model(raw["model_type"], **kw))
    text_model = model.model.language_model if family.vision else model.model
    n = sum(p.numel() for p in text_model.parameters()) + sum(p.numel() for p in model.lm_head.parameters())
    if raw.get("tie_word_embeddings") or family.text_config(raw).get("tie_word_embeddings"):
        n -= model.lm_head.weight.numel()  # one shared tensor
    assert model_parameters(text_config(raw)) == n


@pytest.mark.parametrize("raw,lora", [
    (MOE_TINY, {"target_modules": ["q_proj", "in_proj_qkv", "gate_proj", "down_proj"],
                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}),
    (NEXT_TINY, {"target_modules": ["q_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"],
                 "target_parameters": ["experts.down_proj"]}),
], ids=["qwen3_5_moe_text", "qwen3_next"])
def test_expert_lora_parameters_match_peft(raw, lora):
    from packtrain.models.build import apply_lora, build_base_model

    cfg = config_from_dict({"model": {"config": raw}, "lora": {"r": 4, "dropout": 0.0, **lora}})
    model = apply_lora(build_base_model(cfg), cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    counted = lora_parameters(text_config(raw), 4, lora["target_modules"], lora["target_parameters"])
    assert counted == trainable


def test_an_adapter_on_the_head_and_saved_modules_match_peft():
    """lm_head as a LoRA target (r x (hidden + vocab)), and the trained copies of lora.modules_to_save."""
    from packtrain.models.build import apply_lora, build_base_model
    from packtrain.models.parameters import saved_module_parameters

    targets, saved = ["q_proj", "lm_head"], ["embed_tokens"]
    cfg = config_from_dict({"model": {"config": TINY_MODEL},
                            "lora": {"r": 4, "target_modules": targets, "modules_to_save": saved}})
    model = apply_lora(build_base_model(cfg), cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    text = text_config(TINY_MODEL)
    assert lora_parameters(text, 4, targets) + saved_module_parameters(text, saved) == trainable
    assert saved_module_parameters(text, ["embed_tokens", "lm_head", "norm"]) == 2 * 1024 * 32
