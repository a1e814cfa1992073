"""Every model family (packtrain.families) trains exactly: packed == standalone (losses and every trainable
gradient: attention, GDN, dense and shared-expert MLPs, routed experts) and == transformers' own forward.

Float64 with the float32 casts of each family's norms and chunk rule removed (`without_float32_casts`), as in
tests/test_parity.py; the bounds are that file's (1e-13 losses, 5e-7 gradients: the GDN gate's `a.float()` stays).
As shipped (float32 casts in), transformers' forward is the reference for the losses (5e-6, as there).
"""

import pytest
import torch

from packtrain.kernels import Backend
from packtrain.model_patch import patch_model
from parity import compare, hf_losses, without_float32_casts
from tiny_models import random_pack, tiny_family_model

L, F = "linear_attention", "full_attention"
BACKEND = Backend(gdn="torch", attention="batched")

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
    with torch.no_grad():
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


@pytest.mark.parametrize("model_type,layer_types,prefix_len,specs", CASES[::2], ids=IDS[::2])
def test_as_shipped_equals_transformers(model_type, layer_types, prefix_len, specs):
    prefix, conts = random_pack(prefix_len, specs, seed=prefix_len)
    model = _model(model_type, layer_types)
    d = compare(model, prefix, conts)
    assert d.loss < 5e-6 and d.grad < 1e-4, d
    reference = torch.tensor(hf_losses(model, prefix, conts), dtype=torch.float64)
    packed = torch.tensor(d.losses_a, dtype=torch.float64)
    assert ((packed - reference).abs() / reference.abs()).max() < 5e-6


def test_moe_trains_experts_and_shared_expert_not_router():
    model = tiny_family_model("qwen3_5_moe_text", [L, F])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("mlp.experts" in n and "lora_A" in n for n in trainable)
    assert any("shared_expert.down_proj.lora_B" in n for n in trainable)
    assert not any(".mlp.gate." in n for n in trainable)
