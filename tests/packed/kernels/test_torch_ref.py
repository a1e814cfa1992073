"""The pure-torch chunk rule against the token-by-token update equation and against transformers' fallback."""

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from packtrain.packed.kernels import torch_ref


def _inputs(B, T, H, HV, K, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, HV, V, generator=g, dtype=dtype)
    gate = -torch.rand(B, T, HV, generator=g, dtype=dtype)  # log decay <= 0
    beta = torch.rand(B, T, HV, generator=g, dtype=dtype)
    h0 = torch.randn(B, HV, K, V, generator=g, dtype=dtype)
    return q, k, v, gate, beta, h0


@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
def test_chunk_rule_equals_recurrence_float64(T):
    q, k, v, g, beta, h0 = _inputs(2, T, 2, 4, 8, 6, torch.float64)
    out, state = torch_ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ref_out, ref_state = torch_ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-12)


def test_chunk_rule_matches_transformers_fallback_float32():
    q, k, v, g, beta, h0 = _inputs(1, 130, 2, 4, 8, 6, torch.float32, seed=1)
    ours, s1 = torch_ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    theirs, s2 = hf.torch_chunk_gated_delta_rule.__wrapped__(q, k, v, g=g, beta=beta, initial_state=h0,
                                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5)


def test_split_at_any_point_equals_one_run():
    """Running a prefix, then the rest from its final state, is the whole sequence (what a pack relies on)."""
    q, k, v, g, beta, _ = _inputs(1, 140, 2, 2, 8, 8, torch.float64, seed=2)
    whole, _ = torch_ref.chunk_gated_delta_rule(q, k, v, g, beta)
    for cut in (1, 64, 70):
        a, s = torch_ref.chunk_gated_delta_rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut],
                                                output_final_state=True)
        b, _ = torch_ref.chunk_gated_delta_rule(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:],
                                                initial_state=s)
        torch.testing.assert_close(torch.cat([a, b], 1), whole, rtol=1e-11, atol=1e-13)


def test_conv_with_history_equals_conv_over_concatenation():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 6, 20, generator=g, dtype=torch.float64)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64)
    whole = torch_ref.causal_conv_silu(x, w, None)
    tail = torch_ref.conv_with_history_silu(x[..., 12:], x[..., 9:12], w, None)
    torch.testing.assert_close(tail, whole[..., 12:], rtol=1e-13, atol=1e-14)


def test_conv_equals_torch_conv1d():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 30, generator=g, dtype=torch.float64)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64)
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(x, w.unsqueeze(1), b, padding=3, groups=6)[..., :30])
    torch.testing.assert_close(torch_ref.causal_conv_silu(x, w, b), ref, rtol=1e-13, atol=1e-14)
