"""fla's two kernels as packtrain calls them, run on CPU under Triton's interpreter (float32), against a float64
pure-torch reference computed one sequence at a time: the gated delta rule with ``cu_seqlens``, a per-sequence
``initial_state`` and its gradient (dh0); the varlen causal conv. Skipped where fla is not installed."""

import torch
from fla_interp import fla_cpu_backend, needs_interpreter

from packtrain.packed.kernels import torch_ref

pytestmark = needs_interpreter

# Sequence lengths around fla's 64-token chunk, one-token sequences, and one spanning three chunks.
LENGTHS = [1, 2, 63, 64, 65, 1, 130]
# Measured here (triton 3.9.0, fla 0.6.0, these inputs): outputs, final states and every gradient agree to
# <= 8.8e-7 relative (max abs error / max abs value; worst dg), float32 accumulation inside fla. 5e-6 keeps ~6x
# headroom and is still five orders of magnitude below a plumbing error (a wrong initial state or segment
# boundary moves values by O(1)).
DELTA_RULE_BOUND = 5e-6
# Measured <= 2.6e-7 (dx): four multiply-adds per output.
CONV_BOUND = 2e-6


def rel64(a, b) -> float:
    """max|a - b| / max|b| in float64, without parity.rel's floor: a reference that is all zero fails (nan)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def _segments(lengths):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(s, s + n) for s, n in zip(starts, lengths)]


def _delta_rule_inputs(lengths, H=2, HV=4, K=16, V=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    q = torch.randn(1, T, H, K, generator=g)
    k = torch.randn(1, T, H, K, generator=g)
    v = torch.randn(1, T, HV, V, generator=g)
    gate = -torch.rand(1, T, HV, generator=g) * 0.5  # log decay in [-0.5, 0]
    beta = torch.rand(1, T, HV, generator=g)
    h0 = torch.randn(N, HV, K, V, generator=g)
    d_out = torch.randn(1, T, HV, V, generator=g)
    d_state = torch.randn(N, HV, K, V, generator=g)
    return [q, k, v, gate, beta, h0], d_out, d_state


def test_delta_rule_varlen_with_initial_states_equals_float64_recurrence():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    fla_cpu_backend()
    inputs, d_out, d_state = _delta_rule_inputs(LENGTHS)
    cu = torch.tensor([0] + [b for _, b in _segments(LENGTHS)], dtype=torch.long)

    got_in = [x.clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = got_in
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    ((out * d_out).sum() + (state * d_state).sum()).backward()

    ref_in = [x.double().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = ref_in
    ref_outs, ref_states = [], []
    for n, (a, b) in enumerate(_segments(LENGTHS)):
        o, s = torch_ref.recurrent_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                                    initial_state=h0[n:n + 1])
        ref_outs.append(o)
        ref_states.append(s)
    ref_out, ref_state = torch.cat(ref_outs, dim=1), torch.cat(ref_states)
    ((ref_out * d_out.double()).sum() + (ref_state * d_state.double()).sum()).backward()

    assert rel64(out, ref_out) < DELTA_RULE_BOUND
    assert rel64(state, ref_state) < DELTA_RULE_BOUND
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], got_in, ref_in):
        assert rel64(a.grad, b.grad) < DELTA_RULE_BOUND, name


def test_call_groups_take_whole_continuations_up_to_the_rows():
    from packtrain.packed.kernels.fla_backend import call_groups

    assert call_groups([30, 50, 40, 200, 10, 90], rows=100) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert call_groups([30, 50], rows=100) == [(0, 2)]
    assert call_groups([], rows=100) == []


def test_continuations_in_several_calls_equal_float64_recurrence(monkeypatch):
    """Every continuation from one shared state (P's, expanded), in calls of at most 100 rows (four calls here): the
    outputs, final states and gradients, the shared state's summed over every call, as the recurrence gives them."""
    from packtrain.packed.kernels import fla_backend

    fla_cpu_backend()
    monkeypatch.setattr(fla_backend, "CALL_ROWS", 100)
    assert len(fla_backend.call_groups(LENGTHS)) == 4
    inputs, d_out, d_state = _delta_rule_inputs(LENGTHS)
    inputs[-1] = inputs[-1][:1]  # one state for all

    got_in = [x.clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = got_in
    H, K, HV, V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]

    def heads(conv, b, a):  # the calls' rows of the q | k | v columns and the gates, as gdn_heads splits them
        qc, kc, vc = conv.split([H * K, H * K, HV * V], dim=-1)
        return qc.reshape(-1, H, K), kc.reshape(-1, H, K), vc.reshape(-1, HV, V), a, b

    conv = torch.cat([q[0].flatten(1), k[0].flatten(1), v[0].flatten(1)], dim=-1)
    out, states = fla_backend.continuations_from_state(heads, conv, beta[0], g[0], LENGTHS, h0, final_state=True)
    ((out * d_out[0]).sum() + (states * d_state).sum()).backward()

    ref_in = [x.double().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = ref_in
    ref_outs, ref_states = [], []
    for a, b in _segments(LENGTHS):
        o, st = torch_ref.recurrent_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                                     initial_state=h0)
        ref_outs.append(o)
        ref_states.append(st)
    ref_out, ref_state = torch.cat(ref_outs, dim=1)[0], torch.cat(ref_states)
    ((ref_out * d_out[0].double()).sum() + (ref_state * d_state.double()).sum()).backward()

    assert rel64(out, ref_out) < DELTA_RULE_BOUND
    assert rel64(states, ref_state) < DELTA_RULE_BOUND
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], got_in, ref_in):
        assert rel64(a.grad, b.grad) < DELTA_RULE_BOUND, name


def test_varlen_conv_equals_float64_per_segment_conv():
    from fla.modules.causal_conv1d import causal_conv1d

    fla_cpu_backend()
    lengths = [1, 3, 4, 70, 2]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, sum(lengths), 24, generator=g)
    weight, bias = torch.randn(24, 4, generator=g), torch.randn(24, generator=g)
    d_out = torch.randn(1, sum(lengths), 24, generator=g)
    cu = torch.tensor([0] + [b for _, b in _segments(lengths)], dtype=torch.long)

    got_in = [t.clone().requires_grad_() for t in (x, weight, bias)]
    out = causal_conv1d(x=got_in[0], weight=got_in[1], bias=got_in[2], activation="silu", cu_seqlens=cu)
    out = out[0] if isinstance(out, tuple) else out
    (out * d_out).sum().backward()

    ref_in = [t.double().requires_grad_() for t in (x, weight, bias)]
    ref = torch.cat([torch_ref.causal_conv_silu(ref_in[0][:, a:b].transpose(1, 2), ref_in[1], ref_in[2])
                     for a, b in _segments(lengths)], dim=-1).transpose(1, 2)
    (ref * d_out.double()).sum().backward()

    assert rel64(out, ref) < CONV_BOUND
    for name, a, b in zip(["dx", "dweight", "dbias"], got_in, ref_in):
        assert rel64(a.grad, b.grad) < CONV_BOUND, name
