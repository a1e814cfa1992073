"""fla's two kernels as packtrain calls them, run on CPU under Triton's interpreter (float32), against a float64
pure-torch reference computed one sequence at a time: the gated delta rule with ``cu_seqlens``, a per-sequence
``initial_state`` and its gradient (dh0); the varlen causal conv. Skipped where fla is not installed."""

import torch
from fla_interp import DELTA_RULE_BOUND, LENGTHS, delta_rule_inputs, fla_cpu_backend, needs_interpreter, rel64, spans_of

from packtrain.packed.kernels import torch_ref

pytestmark = needs_interpreter

# Measured <= 2.6e-7 (dx): four multiply-adds per output.
CONV_BOUND = 2e-6


def test_delta_rule_varlen_with_initial_states_equals_float64_recurrence():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    fla_cpu_backend()
    inputs, d_out, d_state = delta_rule_inputs(LENGTHS)
    cu = torch.tensor([0] + [b for _, b in spans_of(LENGTHS)], dtype=torch.long)

    got_in = [x.clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = got_in
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    ((out * d_out).sum() + (state * d_state).sum()).backward()

    ref_in = [x.double().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = ref_in
    ref_outs, ref_states = [], []
    for n, (a, b) in enumerate(spans_of(LENGTHS)):
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


def test_varlen_conv_equals_float64_per_segment_conv():
    from fla.modules.causal_conv1d import causal_conv1d

    fla_cpu_backend()
    lengths = [1, 3, 4, 70, 2]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, sum(lengths), 24, generator=g)
    weight, bias = torch.randn(24, 4, generator=g), torch.randn(24, generator=g)
    d_out = torch.randn(1, sum(lengths), 24, generator=g)
    cu = torch.tensor([0] + [b for _, b in spans_of(lengths)], dtype=torch.long)

    got_in = [t.clone().requires_grad_() for t in (x, weight, bias)]
    out = causal_conv1d(x=got_in[0], weight=got_in[1], bias=got_in[2], activation="silu", cu_seqlens=cu)
    out = out[0] if isinstance(out, tuple) else out
    (out * d_out).sum().backward()

    ref_in = [t.double().requires_grad_() for t in (x, weight, bias)]
    ref = torch.cat([torch_ref.causal_conv_silu(ref_in[0][:, a:b].transpose(1, 2), ref_in[1], ref_in[2])
                     for a, b in spans_of(lengths)], dim=-1).transpose(1, 2)
    (ref * d_out.double()).sum().backward()

    assert rel64(out, ref) < CONV_BOUND
    for name, a, b in zip(["dx", "dweight", "dbias"], got_in, ref_in):
        assert rel64(a.grad, b.grad) < CONV_BOUND, name
