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


def _chunk_terms(q, k, v, g, beta, use_qk_l2norm_in_kernel: bool, chunk_size: int):
    """The intra-chunk part of the chunked rule, for every chunk at once (nothing here depends on the state).

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] with T a multiple of ``chunk_size``. Returns the
    per-chunk tensors the scan reads, each [B, HV, n_chunks, chunk, ...], in the compute dtype.
    """
    cdt = _compute_dtype(q.dtype)
    B, T, H, K = k.shape
    HV = v.shape[-2]
    if H != HV:
        q = q.repeat_interleave(HV // H, dim=2)
        k = k.repeat_interleave(HV // H, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).to(cdt) for x in (q, k, v, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * K ** -0.5
    n_chunks = T // chunk_size

    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(B, HV, n_chunks, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(B, HV, n_chunks, chunk_size).cumsum(-1)

    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    # one triangular solve for both right-hand sides (one factor walk, one backward solve)
    rhs = torch.cat([v_beta, k_beta * g.exp().unsqueeze(-1)], dim=-1)
    new_values, k_cumdecay = torch.linalg.solve_triangular(ut_system, rhs, upper=False,
                                                           unitriangular=True).split([v.shape[-1], K], dim=-1)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    return q, k, new_values, k_cumdecay, intra, chunk_decay


def _chunk_step(state, q_c, k_c, nv_c, kc_c, intra_c, d_c):
    """One chunk of the scan: (its output, the state after it)."""
    v_new = nv_c - kc_c @ state
    return q_c @ state + intra_c @ v_new, state * d_c + k_c.transpose(-1, -2) @ v_new


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=True, chunk_size: int = 64, cu_seqlens=None, **unused):
    """Chunked gated delta rule (the algorithm of transformers' torch fallback, same signature as fla's).

    With ``cu_seqlens`` (batch 1, fla's varlen convention) the sequences run independently, each from its own row
    of ``initial_state``, padded only to its own multiple of ``chunk_size`` (:func:`_varlen_chunk_rule`).
    The scan over chunks collects outputs in a list and stacks them once: per-chunk in-place writes into a
    grad-carrying buffer cost a zero-filled gradient per chunk in backward.
    """
    if cu_seqlens is not None:
        return _varlen_chunk_rule(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                  chunk_size, cu_seqlens)
    # q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (fla's and transformers' argument names)
    B, T, H, K = k.shape
    HV, V = v.shape[-2:]
    pad = (chunk_size - T % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, 0, 0, pad)) for x in (beta, g))
    terms = _chunk_terms(q, k, v, g, beta, use_qk_l2norm_in_kernel, chunk_size)
    state = terms[0].new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(terms[0].dtype)
    outs = []
    for chunk in zip(*(x.unbind(2) for x in terms)):
        out_c, state = _chunk_step(state, *chunk)
        outs.append(out_c)
    out = torch.stack(outs, dim=2).reshape(B, HV, -1, V)[:, :, :T]
    return out.transpose(1, 2).to(q.dtype), (state if output_final_state else None)


def varlen_chunk_plan(lengths: list[int], chunk_size: int, device) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """How :func:`_varlen_chunk_rule` lays out sequences of ``lengths`` tokens as chunks.

    Sequences are ranked by chunk count (most first, stable), and chunks are stored step-major: scan step j holds
    chunk j of ranks 0..active[j]-1, which are exactly the sequences that still have a chunk j. Returns
    (gather [chunks * chunk_size] token index per chunk row, len(tokens) for padding; scatter [tokens] the chunk
    row of each token; active[j]; order[rank] = sequence).
    """
    n_chunks = [max(1, -(-n // chunk_size)) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: -n_chunks[i])
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    active = [sum(c > j for c in n_chunks) for j in range(max(n_chunks, default=0))]
    row_start, row_left = [], []  # per chunk: its first token, and how many of its rows are real
    for j, a in enumerate(active):
        for i in order[:a]:
            row_start.append(starts[i] + j * chunk_size)
            row_left.append(lengths[i] - j * chunk_size)
    offs = torch.arange(chunk_size)
    row_start_t, row_left_t = torch.tensor(row_start, dtype=torch.long), torch.tensor(row_left, dtype=torch.long)
    real = offs[None, :] < row_left_t[:, None]
    gather = torch.where(real, row_start_t[:, None] + offs, starts[-1]).flatten()
    scatter = torch.empty(starts[-1], dtype=torch.long)
    scatter[gather[real.flatten()]] = torch.arange(gather.numel())[real.flatten()]
    return gather.to(device), scatter.to(device), active, order


def _varlen_chunk_rule(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, chunk_size,
                       cu_seqlens):
    """Sequences laid end to end in batch 1 ([1, S, ...]), each padded to its own multiple of the chunk: the
    intra-chunk work runs once for all real chunks, then one scan whose batch shrinks as sequences end.
    A chunk's padding rows (zero q, k, v, beta and g) come after its real rows, so causality keeps them out of
    every real output and out of the state (zero keys add nothing, zero log-decay keeps it)."""
    if q.shape[0] != 1:
        raise ValueError("chunk_gated_delta_rule: cu_seqlens needs batch 1 (sequences laid end to end)")
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    S, H, K = k.shape[1:]
    HV, V = v.shape[-2:]
    if cu[0] != 0 or cu[-1] != S or min(lengths, default=0) < 1:
        raise ValueError(f"chunk_gated_delta_rule: cu_seqlens {cu} does not split {S} tokens into non-empty sequences")
    gather, scatter, active, order = varlen_chunk_plan(lengths, chunk_size, q.device)

    def chunked(x):  # [1, S, ...] -> [1, chunks * chunk_size, ...] with zero rows for padding
        x = x[0]
        return torch.cat([x, x.new_zeros((1,) + x.shape[1:])]).index_select(0, gather)[None]

    terms = _chunk_terms(*(chunked(x) for x in (q, k, v, g, beta)), use_qk_l2norm_in_kernel, chunk_size)
    cdt = terms[0].dtype
    n = len(lengths)
    if initial_state is None:
        state = terms[0].new_zeros(HV, n, K, V)
    else:  # [N, HV, K, V] per sequence -> [HV, rank, K, V]
        state = initial_state.to(cdt).index_select(0, torch.tensor(order, device=q.device)).transpose(0, 1)
    outs, finals = [], []
    # split (not slicing) so that backward concatenates the chunk gradients instead of zero-filling per step
    steps = zip(*(x[0].split(active, dim=1) for x in terms))
    for j, chunk in enumerate(steps):
        state = state[:, :active[j]]
        out_c, state = _chunk_step(state, *chunk)
        outs.append(out_c)
        if output_final_state:  # the ranks whose last chunk this was
            finals.append(state[:, active[j + 1] if j + 1 < len(active) else 0:])
    out = torch.cat(outs, dim=1).reshape(HV, -1, V).index_select(1, scatter)
    final = None
    if output_final_state:
        by_rank = torch.cat(finals[::-1], dim=1).transpose(0, 1)  # ranks in order: longest sequences end last
        final = by_rank.index_select(0, torch.tensor(sorted(range(n), key=order.__getitem__), device=q.device))
    return out.transpose(0, 1)[None].to(q.dtype), final


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
    F.conv1d, whose depthwise CPU kernel is slow, in float64 even on tiny inputs (docs/performance.md, "The
    depthwise conv on CPU")."""
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


class _ConvRowsSilu(torch.autograd.Function):
    """:func:`conv_rows_silu` with its backward written out: autograd's would zero-fill one input-sized gradient per
    tap (the backward of each shifted slice) and sum them; here the taps accumulate into one buffer in place, and
    each weight column is one product and sum over the rows. The forward is the same arithmetic as before."""

    @staticmethod
    def forward(ctx, x_RC, weight_CW, bias_C, keep):
        W = weight_CW.shape[-1]
        x = x_RC.to(weight_CW.dtype)
        T = x.shape[0] - (W - 1)
        out = x[0:T] * weight_CW[:, 0]
        for w in range(1, W):
            out = out + x[w:w + T] * weight_CW[:, w]
        pre = out.index_select(0, keep)
        if bias_C is not None:
            pre = pre + bias_C
        ctx.save_for_backward(x, weight_CW, pre, keep)
        ctx.has_bias, ctx.x_dtype = bias_C is not None, x_RC.dtype
        return F.silu(pre).to(x_RC.dtype)

    @staticmethod
    def backward(ctx, d_y):
        x, weight_CW, pre, keep = ctx.saved_tensors
        W = weight_CW.shape[-1]
        T = x.shape[0] - (W - 1)
        d_pre = torch.ops.aten.silu_backward(d_y.to(pre.dtype), pre)
        d_out = d_pre.new_zeros(T, x.shape[1])  # the outputs keep drops (straddling two segments) get none
        d_out[keep] = d_pre
        d_x = torch.empty_like(x)
        torch.mul(d_out, weight_CW[:, 0], out=d_x[0:T])
        d_x[T:].zero_()
        for w in range(1, W):
            d_x[w:w + T].addcmul_(d_out, weight_CW[:, w])
        d_weight = torch.stack([(d_out * x[w:w + T]).sum(0) for w in range(W)], dim=1)
        return d_x.to(ctx.x_dtype), d_weight, d_pre.sum(0) if ctx.has_bias else None, None


def conv_rows_silu(x_RC: torch.Tensor, weight_CW: torch.Tensor, bias_C: torch.Tensor | None,
                   keep: torch.Tensor) -> torch.Tensor:
    """Depthwise conv over rows laid out with their history (rows r..r+W-1 make output r), the outputs ``keep``
    selects, then SiLU; the [time, channel] layout throughout, so no transposes. Same products and sums, in the
    same order, as :func:`causal_conv_silu`."""
    return _ConvRowsSilu.apply(x_RC, weight_CW, bias_C, keep)
