"""GPU back end (fla + FlexAttention) on CUDA. Skipped without CUDA and fla; run by `bash tools/gpu_check.sh`.

- float32 with TF32 off everywhere (torch matmuls, Triton's default dot precision, fla's triangular solve, which
  asks for tf32 explicitly): fla + flex packs against the torch reference and against standalone, within the
  bounds the same kernels meet on CPU under Triton's interpreter (tests/packed/kernels/test_fla_interpreter_model.py).
- bf16: the criterion of tests/mutations.py (a bf16 pack against the same model's bf16 standalone examples, same
  kernels), which correct code meets and each broken plumbing fails: shown on CPU with the torch back end in bf16
  (tests/packed/kernels/test_bf16_criterion.py) and here with fla.
- FlexAttention compilations over many pack lengths, counted with inductor: at most two.
"""

import os

import pytest
import torch

from packtrain.packed.kernels import Backend, fla_available
from packtrain.packed.patch import patch_model

HAVE_GPU = torch.cuda.is_available() and fla_available()
if HAVE_GPU:  # read when Triton compiles a kernel, so before any runs: tl.dot without a precision is ieee
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

from fla_interp import fla_kernel_global
from mutations import GPU_SPECS, MUTATIONS, bf16_criterion_holds, break_plumbing, long_memory_model
from parity import compare, packed_run, rel, standalone_run
from test_fla_interpreter_model import GRAD_BOUND, LOSS_BOUND
from tiny_models import random_pack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs CUDA and fla")]
L, F = "linear_attention", "full_attention"
FLA = Backend("fla", "flex")
REFERENCE = Backend("torch", "batched")


@pytest.fixture(scope="module", autouse=True)
def tf32_off():
    """TF32 off for this module's float32 checks, and everything put back after it: torch's flags, and fla's
    triangular-solve precision (a global its kernels read when they compile; :func:`fla_kernel_global` makes
    them compile again on both changes, so the modules around this one run in any order)."""
    import triton.language as tl
    from fla.ops.gated_delta_rule import chunk_fwd

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    with fla_kernel_global(chunk_fwd, "SOLVE_TRIL_DOT_PRECISION", tl.constexpr("ieee")):
        yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def _cuda_model(dtype, backend, seed=0):
    return patch_model(long_memory_model([L, F, L, L, F], seed=seed).to("cuda", dtype), backend)


def _diffs(a, b):
    (la, ga), (lb, gb) = a, b
    loss = rel(torch.tensor(la, dtype=torch.float64), torch.tensor(lb, dtype=torch.float64))
    return loss, max(rel(ga[n].float(), gb[n].float()) for n in gb)


@pytest.mark.parametrize("prefix_len", [1, 65, 300])
def test_fp32_fla_flex_equals_torch_reference_and_standalone(prefix_len):
    prefix, conts = random_pack(prefix_len, GPU_SPECS, seed=prefix_len)
    model = _cuda_model(torch.float32, FLA)
    got = packed_run(model, prefix, conts)
    for name, ref in (("torch reference", packed_run(_cuda_model(torch.float32, REFERENCE), prefix, conts)),
                      ("standalone", standalone_run(model, prefix, conts))):
        loss, grad = _diffs(got, ref)
        assert loss < LOSS_BOUND and grad < GRAD_BOUND, (name, loss, grad)


@pytest.mark.parametrize("prefix_len", [1, 65, 300])
def test_bf16_fla_meets_the_criterion(prefix_len):
    prefix, conts = random_pack(prefix_len, GPU_SPECS, seed=prefix_len)
    d = compare(_cuda_model(torch.bfloat16, FLA), prefix, conts)
    assert bf16_criterion_holds(d), d


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_bf16_broken_plumbing_fails_the_criterion_on_fla(mutation, monkeypatch):
    break_plumbing(mutation, monkeypatch)
    prefix, conts = random_pack(65, GPU_SPECS, seed=65)
    d = compare(_cuda_model(torch.bfloat16, FLA), prefix, conts)
    assert not bf16_criterion_holds(d), (mutation, d)


def test_fp32_vlm_fla_flex_equals_torch_reference():
    """Vision-language packs on the GPU back end against the torch reference (tests/packed/test_vlm.py's fixture)."""
    from tiny_models import tiny_vlm, vlm_pack

    from packtrain.packed.patch import vision_spec

    prefix, conts, pixels = vlm_pack(seed=0)
    results = []
    for backend in (REFERENCE, FLA):
        model = patch_model(tiny_vlm(seed=0).to("cuda", torch.float32), backend)
        px = [[p.to("cuda", torch.float32) for p in per] for per in pixels]
        results.append(packed_run(model, prefix, conts, vision_spec(model), px))
    loss, grad = _diffs(results[1], results[0])
    assert loss < LOSS_BOUND and grad < GRAD_BOUND, (loss, grad)


def test_flex_compiles_at_most_twice_over_many_pack_lengths():
    from test_flex_compile import PACKS
    from torch._dynamo.utils import counters

    from packtrain.packed.attention import attention_dense
    from packtrain.packed.kernels import flex
    from packtrain.packed.layout import build_pack_layout

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    g = torch.Generator(device="cuda").manual_seed(0)
    for prefix_len, specs in PACKS + [(4000, [(100, 28)] * 9)]:
        layout = build_pack_layout(*random_pack(prefix_len, specs, seed=prefix_len)).to("cuda")
        T = layout.length
        q, k, v = (torch.randn(1, h, T, 16, generator=g, device="cuda", requires_grad=True) for h in (4, 2, 2))
        got = flex.flex_attention(q, k, v, layout, 0.25, 0.0)
        got.sum().backward()
        ref = attention_dense(q.detach(), k.detach(), v.detach(), layout, 0.25, 0.0)
        torch.testing.assert_close(got.detach(), ref, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - before <= 2
