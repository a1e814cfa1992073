"""GPU back end (fla + FlexAttention) against the torch reference. Skipped without CUDA and fla.

Run on a GPU machine with `bash tools/gpu_check.sh` (installs fla from carried wheels and prints a table).
"""

import pytest
import torch

from packtrain.kernels import Backend, fla_available
from packtrain.model_patch import patch_model
from parity import compare, packed_run, rel
from tiny_models import random_pack, tiny_lora_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not fla_available(), reason="needs CUDA and fla"),
]
L, F = "linear_attention", "full_attention"
SPECS = [(0, 1), (3, 2), (70, 5), (130, 20), (10, 1), (64, 64)]
# (dtype, loss bound, grad bound): float32 ~ fla's tf32/fp32 accumulation; bf16 ~ bf16 storage of every activation
BOUNDS = {torch.float32: (1e-3, 2e-2), torch.bfloat16: (3e-2, 2e-1)}


def _cuda_model(dtype, backend, seed=0):
    model = tiny_lora_model([L, F, L, L, F], dtype=torch.float32, seed=seed).to("cuda", dtype)
    return patch_model(model, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("prefix_len", [1, 65, 300])
def test_fla_flex_equals_torch_reference(dtype, prefix_len):
    prefix, conts = random_pack(prefix_len, SPECS, seed=prefix_len)
    ref_l, ref_g = packed_run(_cuda_model(torch.float32, Backend("torch", "batched")), prefix, conts)
    got_l, got_g = packed_run(_cuda_model(dtype, Backend("fla", "flex")), prefix, conts)
    loss_bound, grad_bound = BOUNDS[dtype]
    assert rel(torch.tensor(got_l, dtype=torch.float64), torch.tensor(ref_l, dtype=torch.float64)) < loss_bound
    for n in ref_g:
        assert rel(got_g[n].float(), ref_g[n].float()) < grad_bound, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_packed_equals_standalone(dtype):
    prefix, conts = random_pack(65, SPECS, seed=1)
    d = compare(_cuda_model(dtype, Backend("fla", "flex")), prefix, conts)
    loss_bound, grad_bound = BOUNDS[dtype]
    assert d.loss < loss_bound and d.grad < grad_bound, d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vlm_fla_flex_equals_torch_reference(dtype):
    """Vision-language packs on the GPU back end against the torch reference (tests/test_vlm.py's fixture)."""
    from test_vlm import tiny_vlm, vlm_pack

    from packtrain.model_patch import vision_spec

    prefix, conts, pixels = vlm_pack(seed=0)
    results = []
    for backend, dt in ((Backend("torch", "batched"), torch.float32), (Backend("fla", "flex"), dtype)):
        model = patch_model(tiny_vlm(seed=0).to("cuda", dt), backend)
        px = [[p.to("cuda", dt) for p in per] for per in pixels]
        results.append(packed_run(model, prefix, conts, vision_spec(model), px))
    (ref_l, ref_g), (got_l, got_g) = results
    loss_bound, grad_bound = BOUNDS[dtype]
    assert rel(torch.tensor(got_l, dtype=torch.float64), torch.tensor(ref_l, dtype=torch.float64)) < loss_bound
    for n in ref_g:
        assert rel(got_g[n].float(), ref_g[n].float()) < grad_bound, n
