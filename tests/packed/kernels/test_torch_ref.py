"""The pure-torch chunk rule against the token-by-token update equation and against transformers' fallback; its
varlen form (the CPU back end's continuations) against the recurrence per sequence and against the padded batch from
one shared state, in float64."""

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


# -- the varlen chunk rule (cu_seqlens) --------------------------------------------------------------------------------
LENGTHS = [[1], [64], [65], [1, 64, 65, 3, 130, 64, 2]]


def _sequences(lengths, seed=0, H=2, HV=4, K=8, V=6):
    g = torch.Generator().manual_seed(seed)
    S, n = sum(lengths), len(lengths)
    q = torch.randn(1, S, H, K, generator=g, dtype=torch.float64)
    k = torch.randn(1, S, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(1, S, HV, V, generator=g, dtype=torch.float64)
    gate = -torch.rand(1, S, HV, generator=g, dtype=torch.float64)
    beta = torch.rand(1, S, HV, generator=g, dtype=torch.float64)
    h0 = torch.randn(n, HV, K, V, generator=g, dtype=torch.float64)  # a different initial state per sequence
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return [x.requires_grad_() for x in (q, k, v, gate, beta, h0)], cu


@pytest.mark.parametrize("chunk", [64, 32, 16])  # 64: P's and fla's chunk; 16: the continuations' (gdn.py)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda ls: "-".join(map(str, ls)))
def test_varlen_chunk_rule_equals_recurrence_per_sequence(lengths, chunk):
    (q, k, v, gate, beta, h0), cu = _sequences(lengths)
    out, final = torch_ref.chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=h0, output_final_state=True,
                                                  cu_seqlens=torch.tensor(cu, dtype=torch.int32), chunk_size=chunk)
    refs, ref_finals = [], []
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        o, s = torch_ref.recurrent_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], gate[:, a:b], beta[:, a:b],
                                                    initial_state=h0[i:i + 1])
        refs.append(o)
        ref_finals.append(s)
    ref, ref_final = torch.cat(refs, 1), torch.cat(ref_finals)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, ref_final, rtol=1e-10, atol=1e-12)
    # backward, through the shrinking scan and into every sequence's own initial state
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    wf = torch.randn(final.shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    inputs = (q, k, v, gate, beta, h0)
    ours = torch.autograd.grad((out * w).sum() + (final * wf).sum(), inputs)
    theirs = torch.autograd.grad((ref * w).sum() + (ref_final * wf).sum(), inputs)
    for name, a, b in zip("q k v g beta h0".split(), ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


def test_varlen_chunk_rule_from_one_shared_state_equals_padded_batch():
    """What a pack runs: every continuation from P's state (broadcast), varlen vs the padded-batch rule."""
    lengths = [5, 70, 64, 1]
    (q, k, v, gate, beta, h0), cu = _sequences(lengths, seed=1)
    shared = h0[:1].expand(len(lengths), -1, -1, -1)
    out, _ = torch_ref.chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=shared, cu_seqlens=cu)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        alone, _ = torch_ref.chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], gate[:, a:b], beta[:, a:b],
                                                    initial_state=h0[:1])
        torch.testing.assert_close(out[:, a:b], alone, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("cu", [[0, 3, 3, 10], [1, 10], [0, 9]])
def test_varlen_chunk_rule_rejects_bad_cu_seqlens(cu):
    (q, k, v, gate, beta, _), _ = _sequences([10])
    with pytest.raises(ValueError, match="cu_seqlens"):
        torch_ref.chunk_gated_delta_rule(q, k, v, gate, beta, cu_seqlens=cu)


def test_varlen_chunk_plan_table():
    # lengths 3, 130, 64 in chunks of 64: 1, 3 and 1 chunks; ranked 130 first; step 0 holds all three
    gather, scatter, active, order = torch_ref.varlen_chunk_plan([3, 130, 64], 64, "cpu")
    assert order == [1, 0, 2] and active == [3, 1, 1]
    rows = gather.view(-1, 64)
    assert rows[0, :3].tolist() == [3, 4, 5]  # step 0, rank 0: the 130-token sequence's first chunk
    assert rows[1, :3].tolist() == [0, 1, 2] and rows[1, 3:].eq(197).all()  # rank 1: 3 tokens, then padding
    assert rows[4, :2].tolist() == [131, 132] and rows[4, 2:].eq(197).all()  # step 2: tokens 128-129 of 130
    assert torch.equal(gather[scatter], torch.arange(197))
