"""Shape-only stand-ins for fla's GDN kernels, for ``plan --memory --measure`` under fake tensors.

fla's Triton kernels cannot run on fake tensors, and the CPU reference keeps per-chunk states that fla does not
(95 GiB at a 133K-position pack of Qwen3.6-27B). These autograd functions take fla's arguments, allocate what fla's
allocate (outputs, and the transients alive inside forward and backward) and save what fla's save for backward,
read from fla 0.6: ``ChunkGatedDeltaRuleFunction`` (``fla/ops/gated_delta_rule/chunk.py``) and
``CausalConv1dFunction`` (``fla/modules/causal_conv1d/ops.py``). :func:`installed` puts them where
:mod:`packtrain.packed.kernels.fla_backend` calls fla, for the measurement only. Shape legend as there: B batch,
T time, H key heads, HV value heads, K/V head dims, NT chunks of 64.
"""

from __future__ import annotations

import contextlib

import torch

CHUNK = 64  # fla's chunk (BT) for the gated delta rule


def _chunks(T: int, cu_seqlens) -> int:
    if cu_seqlens is None:
        return -(-T // CHUNK)
    cu = cu_seqlens.tolist()  # real: the layout's index tensors are real under the measurement
    return sum(-(-(b - a) // CHUNK) for a, b in zip(cu, cu[1:]))


class _DeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
        # fla's input_guard makes every tensor argument contiguous: v, a view of the conv's output, is saved as a
        # copy of its own, and the conv's [T, conv_dim] output is not kept alive by it
        v, beta = v.contiguous(), beta.contiguous()
        B, T, H, K = k.shape
        HV, V = v.shape[-2:]
        f32 = torch.float32
        q, q_rstd = torch.empty_like(q), q.new_empty(B, T, H, dtype=f32)  # l2norm_fwd: y, rstd
        k, k_rstd = torch.empty_like(k), k.new_empty(B, T, H, dtype=f32)
        g = torch.empty_like(g, dtype=f32)  # chunk_local_cumsum
        A = k.new_empty(B, T, HV, CHUNK)  # the solved (I + A)^-1 blocks
        w, u = k.new_empty(B, T, HV, K), torch.empty_like(v)  # recompute_w_u_fwd
        nt = B * _chunks(T, cu_seqlens)
        h, v_new = k.new_empty(nt, HV, K, V), torch.empty_like(u)  # chunk_gated_delta_rule_fwd_h
        n = B if cu_seqlens is None else cu_seqlens.numel() - 1
        final = k.new_zeros(n, HV, K, V, dtype=f32) if output_final_state else None
        o = torch.empty_like(v)  # chunk_fwd_o
        del w, u, h, v_new
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A, initial_state)
        ctx.nt = nt
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        # chunk_gated_delta_rule_bwd's allocations in its order, each dropped where its name is rebound or its
        # function returns
        q, q_rstd, k, k_rstd, v, g, beta, A, initial_state = ctx.saved_tensors
        B, T, H, K = k.shape
        HV, V = v.shape[-2:]
        w, u = k.new_empty(B, T, HV, K), torch.empty_like(v)  # recompute_w_u_fwd
        h, v_new = k.new_empty(ctx.nt, HV, K, V), torch.empty_like(u)  # chunk_gated_delta_rule_fwd_h
        dv = torch.empty_like(do)  # chunk_bwd_dv_local
        dh = torch.empty_like(h)  # chunk_gated_delta_rule_bwd_dhu: dh, dh0 and a new dv
        dh0 = None if initial_state is None else torch.empty_like(initial_state, dtype=torch.float32)
        dv = torch.empty_like(dv)
        dq, dk = q.new_empty(B, T, HV, K), k.new_empty(B, T, HV, K)  # chunk_bwd_dqkwg, per value head
        dg, dw = torch.empty_like(g, dtype=torch.float32), torch.empty_like(w)
        if H != HV:
            dq, dk = dq.view(B, T, H, HV // H, K).sum(3), dk.view(B, T, H, HV // H, K).sum(3)
        del h, dh, v_new
        dk2, dv3, db = k.new_empty(B, T, H, K), torch.empty_like(v), torch.empty_like(beta)  # prepare_wy_repr_bwd
        del w, u, dv, dw, dk2
        dq, dk = torch.empty_like(dq), torch.empty_like(dk)  # l2norm_bwd
        return dq, dk, dv3, dg, db, dh0, None, None


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **unused):
    return _DeltaRule.apply(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)  # and residual, initial_state: None here
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        B, T, D = x.shape
        nt = B * -(-T // CHUNK)
        dx = torch.empty_like(x)
        dw = weight.new_empty(nt, *weight.shape, dtype=torch.float32)  # per-block partial sums, then reduced
        db = None if bias is None else bias.new_empty(nt, *bias.shape, dtype=torch.float32)
        return dx, dw.sum(0).to(weight.dtype), None if db is None else db.sum(0).to(bias.dtype)


def causal_conv1d(x, weight=None, bias=None, activation=None, cu_seqlens=None, **unused):
    return _Conv.apply(x, weight, bias), None


def hf_causal_conv1d_fn(x, weight, bias=None, activation=None, **unused):
    """transformers' conv kernel name (x [B, D, T], as the causal_conv1d package takes it): the same saved tensors."""
    return _Conv.apply(x, weight, bias)


@contextlib.contextmanager
def installed():
    """fla's GDN kernels replaced by the stand-ins where packtrain calls them (its packed GDN, and transformers' own
    forward for an unpacked call: a standalone example), restored on exit."""
    import importlib

    from packtrain.packed.kernels.hf_route import MODULES

    try:  # the stand-ins take the place of fla's functions where packtrain's fla back end calls them
        from packtrain.packed.kernels import fla_backend, fla_frozen  # noqa: F401 - both import fla
    except ImportError as e:
        raise ValueError(f"plan --measure: counts fla's GDN kernels and needs the fla package ({e}; pip install "
                         "'packtrain[fla]')") from None

    places = [(fla_backend, "causal_conv1d", causal_conv1d), (fla_backend, "chunk_gated_delta_rule",
              chunk_gated_delta_rule)]  # fla_frozen calls fla_backend's
    for name in MODULES:
        hf = importlib.import_module(name)
        places += [(hf, "torch_chunk_gated_delta_rule", chunk_gated_delta_rule),
                   (hf, "causal_conv1d_fn", hf_causal_conv1d_fn)]
    with replaced(places):
        yield


@contextlib.contextmanager
def replaced(places):
    """Each (module, name, stand-in) of ``places`` set for the block, the originals put back after it."""
    saved = [(m, name, getattr(m, name)) for m, name, _ in places]
    for m, name, fn in places:
        setattr(m, name, fn)
    try:
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)
