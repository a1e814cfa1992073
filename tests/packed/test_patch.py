"""The one patch (packtrain/packed/patch.py): a back end's names picked into its kernels once and given to every
patched layer; the patch idempotent; where a model's parts are, read once from its family's row."""

import pytest
import torch
from tiny_models import patched_lora_model, tiny_lora_model, tiny_vlm

from packtrain.packed import attention, gdn, tree
from packtrain.packed.kernels import Backend
from packtrain.packed.patch import UnsupportedModelError, model_parts, patch_model, pick_kernels, text_parts, unwrap

L, F = "linear_attention", "full_attention"


@pytest.mark.parametrize("names,expected", [
    (("torch", "batched"), (attention.attention_batched, gdn.conv_torch, gdn.delta_rule_torch, tree.torch_rule)),
    (("torch", "dense"), (attention.attention_dense, gdn.conv_torch, gdn.delta_rule_torch, tree.torch_rule)),
    (("fla", "flex"), (attention.attention_flex, gdn.conv_fla, gdn.delta_rule_fla, tree.fla_rule)),
])
def test_a_back_ends_names_pick_its_kernels(names, expected):
    kernels = pick_kernels(Backend(gdn=names[0], attention=names[1]))
    assert (kernels.attention, kernels.conv, kernels.delta_rule, kernels.tree_rule) == expected


def test_every_patched_layer_holds_the_one_kernels_object_and_a_second_patch_changes_only_the_back_end():
    model = patched_lora_model([L, F, L], backend=Backend(gdn="torch", attention="batched", mlp_rows=7))
    stack, _ = text_parts(model)
    held = {id(m.packtrain_kernels) for m in stack.modules() if hasattr(m, "packtrain_kernels")}
    assert len(held) == 1 and stack.packtrain_kernels.mlp_rows == 7
    gdn_layer = stack.layers[0].linear_attn
    original = gdn_layer._packtrain_original_forward
    patch_model(model, Backend(gdn="torch", attention="dense"))
    assert gdn_layer._packtrain_original_forward is original  # not wrapped twice
    assert stack.packtrain_kernels.attention is attention.attention_dense
    assert stack.layers[0].mlp.packtrain_kernels.mlp_rows is None


def test_a_models_parts_and_positions_come_from_its_family():
    text = unwrap(tiny_lora_model([L, F]))  # Qwen3_5ForCausalLM under peft
    parts = model_parts(text)
    assert parts.text_model is text.model and parts.lm_head is text.lm_head and parts.body is text.model
    assert not parts.vision
    vlm = unwrap(tiny_vlm())  # Qwen3_5ForConditionalGeneration
    vparts = model_parts(vlm)
    assert vparts.vision and vparts.text_model is vlm.model.language_model and vparts.body is vlm.model
    assert vparts.lm_head is vlm.lm_head

    class Positions:  # a layout's M-RoPE position ids: [4, 1, T] (text row first)
        position_ids = torch.arange(20).reshape(4, 1, 5)

    for p in (parts, vparts):  # Qwen3.5 text and VL both take M-RoPE ids; a 1-D family would take row 0
        assert p.mrope and p.positions(Positions()) is Positions.position_ids
    one_d = type(parts)(parts.text_model, parts.lm_head, parts.body, False, False)
    assert torch.equal(one_d.positions(Positions()), Positions.position_ids[0])


def test_a_model_of_no_supported_family_is_refused():
    with pytest.raises(UnsupportedModelError, match="packtrain does not support Linear"):
        model_parts(torch.nn.Linear(2, 2))
