"""packtrain/models/serving.py: which servers apply an adapter, module by module (the rules read from vLLM's and
SGLang's sources; vLLM's also run by `make test-serve`), and the line the run header and `plan` print."""

import pytest
from cli_helpers import REPO

from packtrain.config import load_config
from packtrain.models import serving
from packtrain.models.serving import AdapterModules

GDN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]


def modules(*names, saved=(), vision=False):
    return AdapterModules(frozenset(names), tuple(saved), vision)


def test_vllm_applies_every_qwen35_projection_and_folds_modules_to_save():
    m = modules("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "out_proj", *GDN,
                saved=["lm_head", "embed_tokens"])
    v = serving.vllm(m)
    assert v.serves and v.folded == ("lm_head", "embed_tokens") and v.flags == ()
    assert v.short() == "yes"


@pytest.mark.parametrize("version,serves", [(None, False), ("0.33.1", False), ("0.34.0", True), ("0.35", True)])
def test_a_lone_in_proj_z_needs_vllm_034(version, serves):
    v = serving.vllm(modules("q_proj", "in_proj_z"), version)
    assert v.serves is serves
    if not serves:
        assert list(v.refused) == ["in_proj_z"] and "Cannot determine how to split lora_b" in v.refused["in_proj_z"]
        assert v.short() == "no (in_proj_z)"
    assert serving.vllm(modules("in_proj_qkv"), version).serves  # in_proj_qkv alone: the packed layer's first part


def test_vllm_refuses_modules_it_does_not_have_and_the_vision_tower():
    v = serving.vllm(modules("q_proj", "qkv", "shared_expert_gate", vision=True))
    assert list(v.refused) == ["visual.*", "qkv", "shared_expert_gate"]
    assert "stops at unexpected modules" in v.refused["qkv"]


def test_routed_experts_need_the_mixed_moe_format_in_vllm_and_are_refused_by_sglang():
    m = AdapterModules.of_config(["q_proj", "in_proj_qkv", "gate_proj"], ["mlp.experts.gate_up_proj",
                                                                           "mlp.experts.down_proj"], None)
    assert m.lora == {"q_proj", "in_proj_qkv", "gate_proj", "experts"}
    v = serving.vllm(m)
    assert v.serves and v.flags == ("--enable-mixed-moe-lora-format",)
    assert v.short() == "yes (--enable-mixed-moe-lora-format)"
    s = serving.sglang(m)
    assert list(s.refused) == ["experts", "in_proj_qkv"]
    assert "target_parameters" in s.refused["experts"] and "get_hidden_dim" in s.refused["in_proj_qkv"]


def test_sglang_refuses_each_split_gdn_projection_and_applies_the_rest():
    s = serving.sglang(modules("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                               "out_proj", *GDN, saved=["lm_head"]))
    assert sorted(s.refused) == sorted(GDN) and s.folded == ("lm_head",)
    assert serving.sglang(modules("q_proj", "o_proj", "out_proj", "in_proj_qkvz", saved=["merger"])).serves


def test_modules_read_from_adapter_keys():
    keys = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
            "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight",  # peft's gate_up_proj wrapper
            "base_model.model.model.layers.1.mlp.experts.lora_B.weight",  # and its down_proj one
            "base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight",
            "base_model.model.lm_head.weight"]  # a trained module's tensor: not LoRA
    m = AdapterModules.of_keys(keys, ["lm_head"])
    assert m.lora == {"q_proj", "experts", "qkv"} and m.vision and m.saved == ("lm_head",)


@pytest.mark.parametrize("config,line", [
    ("demo.yaml", ("serve: vllm yes, sglang no (in_proj_qkv, in_proj_z), merged yes; lm_head, embed_tokens "
                   "(modules_to_save) folded into the served model by packtrain export --for")),
    ("vlm_demo.yaml", ("serve: vllm yes, sglang no (in_proj_qkv, in_proj_z), merged yes; merger, lm_head "
                       "(modules_to_save) folded into the served model by packtrain export --for")),
    ("qwen3.6-27b.yaml", "serve: vllm yes, sglang yes, merged yes"),
    ("qwen3.6-35b-a3b.yaml", ("serve: vllm yes (--enable-mixed-moe-lora-format), sglang no (experts, in_proj_qkv), "
                              "merged yes")),
])
def test_the_line_for_the_shipped_configs(config, line):
    assert serving.describe(serving.of_lora(load_config(REPO / "configs" / config).lora)) == line


def test_plan_prints_the_serve_line_and_its_json(tmp_path):
    import json

    from cli_helpers import run_in_process

    args = ("plan", REPO / "configs" / "qwen3.6-27b.yaml", "--set", f"data.train={REPO / 'data/demo/train.jsonl'}",
            "--set", "data.format=text")
    assert "serve: vllm yes, sglang yes, merged yes" in run_in_process(*args).stdout
    serve = json.loads(run_in_process(*args, "--json").stdout)["serve"]
    assert serve["vllm"]["serves"] and serve["sglang"]["serves"] and serve["folded"] == []
    demo = json.loads(run_in_process("plan", REPO / "configs" / "demo.yaml", "--json").stdout)["serve"]
    assert demo["sglang"]["serves"] is False and sorted(demo["sglang"]["refused"]) == ["in_proj_qkv", "in_proj_z"]
    assert demo["folded"] == ["lm_head", "embed_tokens"]


@pytest.mark.parametrize("ranks,expected", [([8], 8), ([16], 16), ([4, 20], 32), ([200], 256), ([300], 320)])
def test_vllm_max_lora_rank(ranks, expected):
    assert serving.vllm_lora_rank(ranks) == expected


def test_a_rank_above_vllms_largest_is_refused():
    with pytest.raises(ValueError, match="above the largest vLLM serves"):
        serving.vllm_lora_rank([1024])
