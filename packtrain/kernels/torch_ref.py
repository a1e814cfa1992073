"""Pure-torch kernels for the packed forward: the CPU back end and the reference the GPU back end is tested against.

Shape legend: B batch, T time, H key heads, HV value heads, K key dim, V value dim, C conv channels, W conv width,
N continuations, L longest continuation.

The gated delta rule computes in float32 for float32/bfloat16 inputs (as transformers and fla do) and in
float64 for float64 inputs, so a float64 run really is float64 here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=True, chunk_size: int = 64, cu_seqlens=None, **unused):
    """Chunked gated delta rule (the algorithm of transformers' torch fallback, same signature as fla's).

    The scan over chunks collects outputs in a list and stacks them once: per-chunk in-place writes into a
    grad-carrying buffer cost a zero-filled gradient per chunk in backward.
    """
    if cu_seqlens is not None:
        raise ValueError("the torch chunk rule takes a padded batch, not cu_seqlens")
    # q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (fla's and transformers' argument names)
    out_dtype = q.dtype
    cdt = _compute_dtype(out_dtype)
    B, T, H, K = k.shape
    HV, V = v.shape[-2:]
    if H != HV:
        q = q.repeat_interleave(HV // H, dim=2)
        k = k.repeat_interleave(HV // H, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).to(cdt) for x in (q, k, v, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * K ** -0.5

    pad = (chunk_size - T % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n_chunks = (T + pad) // chunk_size

    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(B, HV, n_chunks, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(B, HV, n_chunks, chunk_size).cumsum(-1)

    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, k_beta * g.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]

    if initial_state is None:
        state = q.new_zeros(B, HV, K, V)
    else:
        state = initial_state.to(cdt)
    outs = []
    for q_c, k_c, nv_c, kc_c, intra_c, d_c in zip(q.unbind(2), k.unbind(2), new_values.unbind(2),
                                                   k_cumdecay.unbind(2), intra.unbind(2), chunk_decay.unbind(2)):
        v_new = nv_c - kc_c @ state
        outs.append(q_c @ state + intra_c @ v_new)
        state = state * d_c + k_c.transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(B, HV, -1, V)[:, :, :T]
    return out.transpose(1, 2).to(out_dtype), (state if output_final_state else None)


def recurrent_gated_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, initial_state=None,
                               use_qk_l2norm_in_kernel=True):
    """Token-by-token gated delta rule, straight from the update equation. Slow; a test reference only.

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,  o_t = S_t^T q_t.
    """
    out_dtype = q_BTHK.dtype
    cdt = _compute_dtype(out_dtype)
    B, T, H, K = k_BTHK.shape
    HV, V = v_BTHV.shape[-2:]
    q, k = q_BTHK.repeat_interleave(HV // H, dim=2).to(cdt), k_BTHK.repeat_interleave(HV // H, dim=2).to(cdt)
    v, g, beta = v_BTHV.to(cdt), g_BTH.to(cdt), beta_BTH.to(cdt)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * K ** -0.5
    state = q.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(cdt)
    outs = []
    for t in range(T):
        state = state * g[:, t].exp()[..., None, None]
        kv_mem = (state * k[:, t, :, :, None]).sum(-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, dim=1).to(out_dtype), state


def _depthwise_valid(x_BCS: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None) -> torch.Tensor:
    """Depthwise conv without padding: out[t] = sum_w weight[:, w] * x[t + w]. W shifted multiply-adds instead of
    F.conv1d, whose depthwise CPU kernel is slow (and ~0.3 s per call in float64 on tiny inputs)."""
    W = weight_CW.shape[-1]
    T = x_BCS.shape[-1] - (W - 1)
    out = x_BCS[..., 0:T] * weight_CW[:, 0, None]
    for w in range(1, W):
        out = out + x_BCS[..., w:w + T] * weight_CW[:, w, None]
    return out if bias_C is None else out + bias_C[:, None]


def causal_conv_silu(x_BCT: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal conv with zero history, then SiLU (transformers' fallback, same dtype handling)."""
    W = weight_CW.shape[-1]
    x = F.pad(x_BCT.to(weight_CW.dtype), (W - 1, 0))
    return F.silu(_depthwise_valid(x, weight_CW, bias_C)).to(x_BCT.dtype)


def conv_with_history_silu(x_BCT: torch.Tensor, history_BCW1: torch.Tensor, weight_CW: torch.Tensor,
                           bias_C: torch.Tensor | None) -> torch.Tensor:
    """Causal conv whose first (W-1) inputs come from ``history`` (the warm-up outputs are never computed)."""
    x = torch.cat([history_BCW1, x_BCT], dim=-1).to(weight_CW.dtype)
    return F.silu(_depthwise_valid(x, weight_CW, bias_C)).to(x_BCT.dtype)
