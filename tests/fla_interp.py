"""Shared by the tests that run the fla back end on CPU: under Triton's interpreter (the skip condition and the
interpreter's back end), or with fla's two kernels replaced by pure-torch varlen stand-ins (the ``fake_fla`` fixture:
a loop over cu_seqlens segments of the torch reference, so the plumbing around them runs without fla)."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch

from packtrain.packed import kernels as kernels_pkg
from packtrain.packed.kernels import fla_available, torch_ref
from packtrain.packed.kernels.interpreter import interpreter_on

# Sequence lengths around fla's 64-token chunk, one-token sequences, and one spanning three chunks.
LENGTHS = [1, 2, 63, 64, 65, 1, 130]
# fla's delta rule against the float64 recurrence, measured under the interpreter (triton 3.9.0, fla 0.6.0, the
# inputs of delta_rule_inputs): outputs, final states and every gradient agree to <= 8.8e-7 relative (max abs error
# / max abs value; worst dg), float32 accumulation inside fla. 5e-6 keeps ~6x headroom and is still five orders of
# magnitude below a plumbing error (a wrong initial state or segment boundary moves values by O(1)).
DELTA_RULE_BOUND = 5e-6


def rel64(a, b) -> float:
    """max|a - b| / max|b| in float64, without parity.rel's floor: a reference that is all zero fails (nan)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def spans_of(lengths):
    """[(start, end)] of sequences of ``lengths`` laid end to end."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(s, s + n) for s, n in zip(starts, lengths)]


def delta_rule_inputs(lengths, H=2, HV=4, K=16, V=8, seed=0):
    """Random varlen delta-rule inputs ([q, k, v, gate, beta, h0]) for sequences of ``lengths``, and the upstream
    gradients of its output and final states."""
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


def _skip_reason() -> str | None:
    if not fla_available():
        return "fla is not installed (pip install -e '.[dev,fla]')"
    if torch.cuda.is_available():
        return "CUDA present: fla runs compiled there (tests/packed/kernels/test_gpu.py)"
    if not interpreter_on():
        return "TRITON_INTERPRET is not set (tests/conftest.py sets it before fla is imported)"
    return None


SKIP_REASON = _skip_reason()
needs_interpreter = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


def fla_cpu_backend():
    from packtrain.packed.kernels import select_backend

    return select_backend("fla", "cpu")  # applies the interpreter shims


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


# The fla-interpreter model tests' shape and bounds (float32 under Triton's interpreter; tests/packed/kernels/
# test_fla_interpreter_model.py measures them), shared with the tree's fla check (tests/packed/test_tree.py)
SMALL_GDN = {"linear_num_key_heads": 1, "linear_num_value_heads": 2}
LOSS_BOUND = 2e-6
GRAD_BOUND = 5e-5


def _jit_function(obj):
    """The JITFunction under Triton's autotuner / heuristics wrappers, else None."""
    from triton.runtime.jit import JITFunction

    while hasattr(obj, "fn") and not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj if isinstance(obj, JITFunction) else None


def _forget_compilations_reading(module, name: str) -> None:
    """Each kernel of ``module`` that read global ``name`` when it compiled forgets that compilation, so its next
    call compiles against the global's current value."""
    for obj in vars(module).values():
        fn = _jit_function(obj)
        if fn is not None and any(key[0] == name for key in fn.used_global_vals):
            fn.hash, fn.used_global_vals = None, {}
            fn.device_caches.clear()


@contextlib.contextmanager
def fla_kernel_global(module, name: str, value):
    """``module.name = value`` for the block, then put back. fla's kernels read such globals when they compile
    (``SOLVE_TRIL_DOT_PRECISION`` in fla.ops.gated_delta_rule.chunk_fwd), and Triton refuses to run a kernel whose
    globals changed after it compiled ("Global variable ... has changed since we compiled this kernel"): on both
    changes every kernel of the module that read it forgets its compilation, so tests before, inside and after the
    block run in any order."""
    old = getattr(module, name)
    setattr(module, name, value)
    _forget_compilations_reading(module, name)
    try:
        yield
    finally:
        setattr(module, name, old)
        _forget_compilations_reading(module, name)
