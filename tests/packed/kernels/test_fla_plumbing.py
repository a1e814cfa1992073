"""The fla back end's index plumbing (tailed varlen conv buffer, cu_seqlens, per-continuation initial states),
checked on CPU in float64 without fla installed: its two kernels are replaced by pure-torch varlen equivalents (a
loop over cu_seqlens segments of the torch reference); tests/test_fla_interpreter*.py run fla's real kernels.
Everything packtrain does around them runs as on the GPU, and must equal the torch back end."""

import sys
import types

import pytest
import torch
from parity import packed_run, without_float32_casts
from tiny_models import patched_lora_model, random_pack

from packtrain.packed import kernels as kernels_pkg
from packtrain.packed.kernels import Backend, torch_ref


def _segments(cu):
    cu = [int(c) for c in cu]
    return list(zip(cu[:-1], cu[1:]))


def fake_causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, **kw):
    assert x.shape[0] == 1 and activation == "silu"
    bounds = _segments(cu_seqlens) if cu_seqlens is not None else [(0, x.shape[1])]
    outs = [torch_ref.causal_conv_silu(x[:, a:b].transpose(1, 2), weight, bias).transpose(1, 2) for a, b in bounds]
    return torch.cat(outs, dim=1), None


def fake_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                                use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kw):
    assert use_qk_l2norm_in_kernel
    if cu_seqlens is None:
        return torch_ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                output_final_state=output_final_state)
    assert q.shape[0] == 1 and initial_state.shape[0] == len(cu_seqlens) - 1
    outs, states = [], []
    for n, (a, b) in enumerate(_segments(cu_seqlens)):
        o, s = torch_ref.chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                                initial_state=initial_state[n:n + 1], output_final_state=True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, dim=1), (torch.cat(states) if output_final_state else None)


@pytest.fixture
def fake_fla(monkeypatch):
    modules = {name: types.ModuleType(name) for name in
               ("fla", "fla.modules", "fla.modules.causal_conv1d", "fla.ops", "fla.ops.gated_delta_rule")}
    modules["fla.modules.causal_conv1d"].causal_conv1d = fake_causal_conv1d
    modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = fake_chunk_gated_delta_rule
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "packtrain.packed.kernels.fla_backend", raising=False)
    # `from packtrain.packed.kernels import fla_backend` reads the package attribute first: where the real back end was
    # imported earlier in the session (the interpreter tests), it would be used instead of the fake one
    real = vars(kernels_pkg).pop("fla_backend", None)
    yield
    sys.modules.pop("packtrain.packed.kernels.fla_backend", None)
    vars(kernels_pkg).pop("fla_backend", None)
    if real is not None:
        kernels_pkg.fla_backend = real


@pytest.mark.parametrize("prefix_len", [1, 2, 65])
def test_fla_plumbing_equals_torch_back_end(fake_fla, monkeypatch, prefix_len):
    with without_float32_casts(monkeypatch):
        prefix, conts = random_pack(prefix_len, [(0, 1), (3, 2), (70, 5), (10, 1)], seed=prefix_len)
        ref = packed_run(patched_lora_model(["linear_attention", "full_attention"], seed=5,
                                            backend=Backend("torch", "batched")), prefix, conts)
        got = packed_run(patched_lora_model(["linear_attention", "full_attention"], seed=5,
                                            backend=Backend("fla", "batched")), prefix, conts)
    assert torch.allclose(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-13, atol=0)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-10, atol=1e-13)
