"""Every model family (packtrain.packed.families) trains exactly: packed == standalone (losses and every trainable
gradient: attention, GDN, dense and shared-expert MLPs, routed experts) and == transformers' own forward.

Tolerances: the bounds of tests/packed/test_parity.py, which hold here with margin. Measured worst case over CASES
(reproduce: the loop of `test_packed_equals_standalone_and_transformers` over CASES):
- float64 with the float32 casts of each family's norms and chunk rule removed (`without_float32_casts`): losses
  4.0e-16, gradients 2.9e-8 (the GDN gate's `a.float()` and the MoE router's float32 softmax stay), losses vs
  transformers' forward logits 5.5e-16. Bounds 1e-13, 5e-7, 1e-13.
- float64 as shipped: losses 3.2e-7 (3.7e-7 vs transformers' loss, which casts logits to float32), gradients
  4.6e-5. Bounds 5e-6 and 1e-4.
A wrong projection split or wrong positions is orders of magnitude above these (b and a swapped in Qwen3-Next's
split: losses 0.12).
"""

import pytest
import torch
from parity import compare, hf_losses, standalone_run, transformers_mlp, without_float32_casts
from tiny_models import random_pack, tiny_family_model

from packtrain.packed.kernels import Backend
from packtrain.packed.patch import patch_model

L, F = "linear_attention", "full_attention"
# dense MLPs (Qwen3-Next, Qwen3) in 7-row tiles, every norm in 5-row tiles
BACKEND = Backend(gdn="torch", attention="batched", mlp_rows=7, norm_rows=5)

# (model type, layer types, prefix length, [(item length, target length), ...])
CASES = [
    ("qwen3_5_moe_text", [L, F, L], 1, [(0, 1), (5, 3), (70, 4)]),
    ("qwen3_5_moe_text", [F, L, L, F], 65, [(0, 2), (63, 1), (3, 6), (10, 1)]),
    ("qwen3_next", [L, L, F, L], 3, [(0, 2), (2, 1), (130, 7)]),
    ("qwen3_next", [F, L, F], 64, [(1, 1), (65, 4), (0, 3)]),
    ("qwen3", [F, F], 2, [(0, 1), (60, 8), (1, 1)]),
    ("qwen3", [F, F, F], 130, [(i % 9, 1 + i % 4) for i in range(9)]),
]
IDS = [f"{c[0]}-P{c[2]}-n{len(c[3])}" for c in CASES]


def hf_float64_losses(model, prefix, conts):
    """transformers' own forward on concat(P, Ci), its logits' cross-entropy in float64 (its loss function casts
    logits to float32, which would bound the comparison at float32 rounding)."""
    out = []
    with torch.no_grad(), transformers_mlp(model):
        for c in conts:
            ids = torch.tensor([list(prefix) + list(c.item_ids) + list(c.target_ids)])
            logits = model(input_ids=ids).logits[0]
            start = len(prefix) + len(c.item_ids)
            out.append(torch.nn.functional.cross_entropy(logits[start - 1:-1], ids[0, start:]).item())
    return torch.tensor(out, dtype=torch.float64)


def _model(model_type, layer_types, seed=0):
    return patch_model(tiny_family_model(model_type, layer_types, seed=seed), BACKEND)


@pytest.mark.parametrize("model_type,layer_types,prefix_len,specs", CASES, ids=IDS)
def test_packed_equals_standalone_and_transformers(model_type, layer_types, prefix_len, specs, monkeypatch):
    prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
    with without_float32_casts(monkeypatch):
        model = _model(model_type, layer_types)
        d = compare(model, prefix, conts)
        reference = hf_float64_losses(model, prefix, conts)
    assert d.loss < 1e-13, d
    assert d.grad < 5e-7, d
    packed = torch.tensor(d.losses_a, dtype=torch.float64)
    assert ((packed - reference).abs() / reference.abs()).max() < 1e-13


@pytest.mark.parametrize("case", [1, 2], ids=[IDS[1], IDS[2]])
def test_loss_in_chunks_of_5_rows_equals_standalone_and_transformers(case, monkeypatch):
    model_type, layer_types, prefix_len, specs = CASES[case]
    prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
    with without_float32_casts(monkeypatch):
        model = _model(model_type, layer_types)
        d = compare(model, prefix, conts, loss_chunk_rows=5)
        reference = hf_float64_losses(model, prefix, conts)
    assert d.loss < 1e-13 and d.grad < 5e-7, d
    packed = torch.tensor(d.losses_a, dtype=torch.float64)
    assert ((packed - reference).abs() / reference.abs()).max() < 1e-13


@pytest.mark.parametrize("model_type,layer_types,prefix_len,specs", CASES[::2], ids=IDS[::2])
def test_as_shipped_equals_transformers(model_type, layer_types, prefix_len, specs):
    prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
    model = _model(model_type, layer_types)
    d = compare(model, prefix, conts)
    assert d.loss < 5e-6 and d.grad < 1e-4, d
    reference = torch.tensor(hf_losses(model, prefix, conts), dtype=torch.float64)
    packed = torch.tensor(d.losses_a, dtype=torch.float64)
    assert ((packed - reference).abs() / reference.abs()).max() < 5e-6


# One case per family: each packing.context_grad packed == the same mode standalone. A mixture of experts runs its
# routed experts on gathered token subsets: kv_only's row-sparse backward must leave them dense (applied to the
# whole MoE block it gave gradients 0.66 (qwen3_5_moe) and 1.1 (qwen3_next) apart, and a narrow() error at P 65).
@pytest.mark.parametrize("mode", ["kv_only", "frozen"])
@pytest.mark.parametrize("case", [1, 2, 4], ids=[IDS[i] for i in (1, 2, 4)])
def test_context_grad_modes_per_family(case, mode, monkeypatch):
    model_type, layer_types, prefix_len, specs = CASES[case]
    prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
    with without_float32_casts(monkeypatch):
        d = compare(_model(model_type, layer_types), prefix, conts, context_grad=mode)
    assert d.loss < 1e-13, d
    assert d.grad < 5e-7, d


@pytest.mark.parametrize("case", [1, 2, 4], ids=[IDS[i] for i in (1, 2, 4)])
def test_walk_horizon_all_per_family(case, monkeypatch):
    """The walk (packing.on_overflow: walk) on each family == the whole example standalone. 1-D RoPE families take
    row 0 of the positions (given the M-RoPE rows, qwen3 and qwen3_next raised)."""
    from test_walk import _check, walk_run

    from packtrain.data.walk_calls import WalkSpec

    model_type, layer_types, _, _ = CASES[case]
    prefix, (cont,) = random_pack(3, [(20, 30)], seed=3)
    with without_float32_casts(monkeypatch):
        model = _model(model_type, layer_types)
        la, ga = walk_run(model, prefix, cont, WalkSpec(16, None))
        (lb,), gb = standalone_run(model, prefix, [cont])
    _check(la, ga, lb, gb, 1e-12, 1e-10)


def test_moe_trains_experts_and_shared_expert_not_router():
    model = tiny_family_model("qwen3_5_moe_text", [L, F])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("mlp.experts" in n and "lora_A" in n for n in trainable)
    assert any("shared_expert.down_proj.lora_B" in n for n in trainable)
    assert not any(".mlp.gate." in n for n in trainable)


# -- refusals and LoRA targeting (in process; tests/commands/test_families_cli.py runs two refusals through the CLI) --

def _cfg(model, lora=None):
    from packtrain.config import config_from_dict

    return config_from_dict({"model": {"config": model, "dtype": "float64"}, "lora": lora or {}})


QWEN3 = {"model_type": "qwen3", "vocab_size": 97, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 3,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}


@pytest.mark.parametrize("model,expected", [
    ({"model_type": "qwen4_exp"}, "model.config.model_type: 'qwen4_exp' is not a model family packtrain supports "
                                  "(supported: qwen3_5_text, qwen3_5, qwen3_5_moe_text, qwen3_5_moe, qwen3_next, qwen3)"),
    ({"model_type": "qwen3_5", "text_config": {"layer_types": [L, "sliding_attention"]}},
     "model.config.text_config.layer_types[1]: decoder layer type 'sliding_attention' is not supported for qwen3_5"),
    ({**QWEN3, "layer_types": [F, "linear_attention", F]}, "layer_types[1]: decoder layer type 'linear_attention'"),
    # layer types transformers derives itself: Qwen3's sliding-window layers from use_sliding_window
    ({**QWEN3, "use_sliding_window": True, "max_window_layers": 1}, "decoder layer type 'sliding_attention'"),
    ({"vocab_size": 97}, "model.config.model_type: missing"),
])
def test_unsupported_models_are_refused_naming_what(model, expected):
    from packtrain.models.build import build_base_model
    from packtrain.packed.families import UnsupportedModelError, check_model

    with pytest.raises(UnsupportedModelError) as e:
        cfg = _cfg(model)
        check_model(cfg)
        build_base_model(cfg)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_model_directory_of_an_unsupported_type_is_refused(tmp_path):
    import json

    from packtrain.config import config_from_dict
    from packtrain.packed.families import check_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen4_exp"}))
    with pytest.raises(ValueError, match=r"config.json.model_type: 'qwen4_exp' is not a model family"):
        check_model(config_from_dict({"model": {"path": str(tmp_path)}}))


def test_expert_lora_needs_dropout_zero():
    from packtrain.config import ConfigError

    with pytest.raises(ConfigError, match="lora.dropout: must be 0 with lora.target_parameters"):
        _cfg(QWEN3, {"target_parameters": ["mlp.experts.down_proj"], "dropout": 0.05})


NEXT = {"model_type": "qwen3_next", "vocab_size": 97, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "layer_types": [L, F], "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
        "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8, "num_experts": 3, "num_experts_per_tok": 2}


def _lora(model, lora):
    from packtrain.models.build import apply_lora, build_base_model

    cfg = _cfg(model, {"dropout": 0.0, **lora})
    peft_model = apply_lora(build_base_model(cfg), cfg)
    return {n for n, p in peft_model.named_parameters() if p.requires_grad}


def test_target_parameters_matching_nothing_are_refused():
    with pytest.raises(ValueError, match=r"lora.target_parameters: 'mlp.experts.down_proj' matches no parameter"):
        _lora(QWEN3, {"target_parameters": ["mlp.experts.down_proj"]})


def test_router_stays_frozen():
    with pytest.raises(ValueError, match=r"lora: the MoE router \(mlp.gate\) stays frozen"):
        _lora(NEXT, {"target_modules": ["q_proj"], "target_parameters": ["mlp.gate.weight"]})


def test_peft_renaming_of_mlp_names_is_refused_or_left_out_of_the_default():
    """peft 0.21 rewrites gate_proj/up_proj/down_proj on qwen3_next into the routed experts (dropping the shared
    expert's adapters): an explicit list is refused, the default list leaves them out."""
    with pytest.raises(ValueError, match=r"lora.target_modules: gate_proj, up_proj on qwen3_next: peft reads"):
        _lora(NEXT, {"target_modules": ["q_proj", "gate_proj", "up_proj"]})
    trainable = _lora(NEXT, {})  # default [q_proj, k_proj, v_proj, o_proj, gate_proj]
    assert any(".self_attn.o_proj.lora_A" in n for n in trainable)
    assert not any("gate_proj" in n or "experts" in n for n in trainable)
    # on qwen3_5_moe_text (no such conversion) the same default adapts the shared expert's gate_proj
    moe = {**NEXT, "model_type": "qwen3_5_moe_text"}
    del moe["intermediate_size"]
    assert any(".shared_expert.gate_proj.lora_A" in n for n in _lora(moe, {}))


def test_memory_plan_refuses_an_unsupported_model_in_one_line():
    from packtrain.models.text_config import text_config
    from packtrain.packed.families import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"^model.config.model_type: 'qwen4_exp' is not a model family"):
        text_config({"model_type": "qwen4_exp"})
