"""fla's back end for the packed Gated DeltaNet (packtrain/packed/kernels/fla_backend.py).

- Its index plumbing (tailed varlen conv buffer, cu_seqlens, per-continuation initial states), checked on CPU in
  float64 without fla installed: fla's two kernels are replaced by pure-torch varlen equivalents (``fake_fla``, a
  loop over cu_seqlens segments of the torch reference). Everything packtrain does around them runs as on the GPU,
  and must equal the torch back end.
- The continuations' delta rule in calls of whole continuations, with fla's real kernels under Triton's
  interpreter (float32) against a float64 recurrence computed one sequence at a time (skipped where fla is not
  installed); fla's kernels alone: tests/packed/kernels/test_fla_interpreter.py.
"""

import pytest
import torch
from fla_interp import (  # noqa: F401 - fake_fla: a fixture, used by name
    DELTA_RULE_BOUND,
    LENGTHS,
    delta_rule_inputs,
    fake_fla,
    fla_cpu_backend,
    needs_interpreter,
    rel64,
    spans_of,
)
from parity import packed_run, without_float32_casts
from tiny_models import patched_lora_model, random_pack

from packtrain.packed.kernels import Backend, torch_ref


@pytest.mark.usefixtures("fake_fla")
@pytest.mark.parametrize("prefix_len", [1, 2, 65])
def test_fla_plumbing_equals_torch_back_end(monkeypatch, prefix_len):
    with without_float32_casts(monkeypatch):
        prefix, conts = random_pack(prefix_len, [(0, 1), (3, 2), (70, 5), (10, 1)], seed=prefix_len)
        ref = packed_run(patched_lora_model(["linear_attention", "full_attention"], seed=5,
                                            backend=Backend("torch", "batched")), prefix, conts)
        got = packed_run(patched_lora_model(["linear_attention", "full_attention"], seed=5,
                                            backend=Backend("fla", "batched")), prefix, conts)
    assert torch.allclose(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-13, atol=0)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-10, atol=1e-13)


@pytest.mark.usefixtures("fake_fla")
@pytest.mark.parametrize("tree", [False, True], ids=["pack", "tree"])
def test_varlen_calls_get_int64_bounds_with_their_host_copy_built_once_per_layout(monkeypatch, tree):
    """Every varlen call of fla (the conv and the delta rule, in every GDN layer) gets int64 ``cu_seqlens`` and its
    host copy ``cu_seqlens_cpu`` (without it fla syncs with the device per call), the same tensors in every layer of
    one pack: built once per layout, so fla's own cache of what it derives from them hits."""
    import sys
    from collections import Counter

    fla_conv = sys.modules["fla.modules.causal_conv1d"]
    fla_rule = sys.modules["fla.ops.gated_delta_rule"]
    calls = []

    def spy(fn, kind):
        def run(*args, **kwargs):
            if kwargs.get("cu_seqlens") is not None:
                calls.append((kind, kwargs["cu_seqlens"], kwargs.get("cu_seqlens_cpu")))
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(fla_conv, "causal_conv1d", spy(fla_conv.causal_conv1d, "conv"))
    monkeypatch.setattr(fla_rule, "chunk_gated_delta_rule", spy(fla_rule.chunk_gated_delta_rule, "rule"))
    L, F = "linear_attention", "full_attention"
    model = patched_lora_model([L, F, L], seed=5, backend=Backend("fla", "batched"))
    if tree:  # P, then s -> {s a, s b -> {s b c, s b d}}: two levels of varlen runs
        from packtrain.packed.layout import Continuation
        from packtrain.packed.lm import PackedLM, TreeCall
        from packtrain.packed.tree import build_tree_layout

        s = [11, 12, 13, 14, 15]
        conts = [Continuation(s + [20, 21], [22]), Continuation(s + [30, 31, 32], [33, 34]),
                 Continuation(s + [30, 31, 32, 40], [41]), Continuation(s, [50, 51])]
        PackedLM(model, "full", 0)(TreeCall(build_tree_layout([5, 6, 7], conts))).loss_sum.backward()
    else:
        prefix, conts = random_pack(5, [(0, 1), (3, 2), (70, 5), (10, 1)], seed=5)
        packed_run(model, prefix, conts)
    assert {kind for kind, _, _ in calls} == {"conv", "rule"}
    for kind, cu, cu_cpu in calls:
        assert cu.dtype == torch.long and cu_cpu is not None and cu_cpu.dtype == torch.long, kind
        assert cu_cpu.device.type == "cpu" and torch.equal(cu_cpu, cu.cpu()), kind
    uses = Counter(id(cu) for _, cu, _ in calls)
    assert set(uses.values()) == {2}, uses  # each bounds tensor reaches both GDN layers: built once, not per call


@needs_interpreter
def test_call_groups_take_whole_continuations_up_to_the_rows():
    from packtrain.packed.kernels.fla_backend import call_groups

    assert call_groups([30, 50, 40, 200, 10, 90], rows=100) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert call_groups([30, 50], rows=100) == [(0, 2)]
    assert call_groups([], rows=100) == []


@needs_interpreter
def test_continuations_in_several_calls_equal_float64_recurrence(monkeypatch):
    """Every continuation from one shared state (P's, expanded), in calls of at most 100 rows (four calls here): the
    outputs, final states and gradients, the shared state's summed over every call, as the recurrence gives them."""
    from packtrain.packed.kernels import fla_backend

    fla_cpu_backend()
    monkeypatch.setattr(fla_backend, "CALL_ROWS", 100)
    assert len(fla_backend.call_groups(LENGTHS)) == 4
    inputs, d_out, d_state = delta_rule_inputs(LENGTHS)
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
    for a, b in spans_of(LENGTHS):
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
