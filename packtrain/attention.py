"""Shared-prefix attention, registered with transformers as the attention implementation ``packtrain``.

The predicate (``layout.shared_prefix_allowed``): P is causal within P; continuation i sees all of P and its own
earlier tokens, nothing of any other continuation. On CPU the continuations' attention runs as two parts merged by
their log-sum-exps (:class:`_SplitAttention`): all continuation queries against P's keys in one call without a
mask, and each length bucket causally against its own keys. Positions are the standalone ones, so RoPE distances from
every continuation to P are exactly those of ``concat(P, Ci)``.

Without a pack layout in the call (a standalone forward), the call goes to transformers' own SDPA attention
with its own causal mask, so the unpacked model computes exactly what it computes as shipped.
Shape legend: H query heads, G key/value heads, T buffer, P prefix, S continuation tokens, N continuations in a
bucket, L the bucket's longest, D head dim.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from packtrain.layout import PackLayout, dense_mask, shared_prefix_allowed

ATTN_NAME = "packtrain"


def _sdpa(q, k, v, mask, scaling, dropout, is_causal=False):
    # enable_gqa: grouped-query attention without materialising the keys/values once per query head
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                          is_causal=is_causal, enable_gqa=k.shape[1] != q.shape[1])


def attention_dense(q_1HTD, k_1GTD, v_1GTD, layout: PackLayout, scaling, dropout):
    """The whole buffer against a dense [T, T] mask from the predicate: simple, O(T^2) memory; a reference."""
    return _sdpa(q_1HTD, k_1GTD, v_1GTD, dense_mask(layout).to(q_1HTD.device), scaling, dropout)


# Padding cost of a bucket, in query rows: a call's fixed overhead is worth about this many rows on CPU.
_CALL_ROWS = 16


@dataclass
class _Bucket:
    index: torch.Tensor  # [n, L] row of each (continuation, position) in the continuation region, S for padding
    mask: torch.Tensor  # [n, 1, L, P + L] all of P, then causal over the continuation's own real keys


def attention_buckets(layout: PackLayout, p: int) -> tuple[list[_Bucket], torch.Tensor]:
    """Continuations grouped by length into padded batches, and [S] the row of each token in the buckets'
    concatenated outputs. The grouping minimises the padded attention work (n x L x (P + L) per bucket, plus a
    call's overhead) over contiguous runs of the continuations sorted by length: equal lengths share one call,
    one long continuation among short ones gets its own instead of padding all of them to it."""
    key = ("attention_buckets", p)  # p: the number of P's keys every query sees
    if key in layout._cache:
        return layout._cache[key]
    lens, starts = layout.cont_lens, layout.cu_seqlens_host
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):
            L = lens[order[i]]
            cost = best[i] + ((j - i) * L + _CALL_ROWS) * (p + L)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    device = layout.input_ids.device
    buckets, unpad, row = [], [0] * starts[-1], 0
    for group in reversed(groups):
        L = lens[group[0]]
        index = torch.full((len(group), L), starts[-1], dtype=torch.long)
        for r, i in enumerate(group):
            index[r, :lens[i]] = torch.arange(starts[i], starts[i + 1])
            unpad[starts[i]:starts[i + 1]] = range(row + r * L, row + r * L + lens[i])
        row += len(group) * L
        valid = index < starts[-1]
        own = torch.ones(L, L, dtype=torch.bool).tril()[None] & valid[:, None, :]
        mask = torch.cat([own.new_ones(len(group), L, p), own], dim=2)[:, None]
        buckets.append(_Bucket(index.to(device), mask.to(device)))
    layout._cache[key] = buckets, torch.tensor(unpad, dtype=torch.long, device=device)
    return layout._cache[key]


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _bucket_rows(x_XSD: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[X, S, ...] -> [n, X, L, ...]: a bucket's rows, zero where ``index`` is S (padding)."""
    pad = x_XSD.new_zeros(x_XSD.shape[:1] + (1,) + x_XSD.shape[2:])
    return torch.cat([x_XSD, pad], dim=1)[:, index].transpose(0, 1)


class _SplitAttention(torch.autograd.Function):
    """The continuations' attention in two parts merged by their log-sum-exps (CPU, no dropout) -> [H, S, D]:
    A. every continuation query against P's keys in one call and no mask (every query sees all of P), the query
       heads of each key/value head stacked along the sequence (grouped-query attention, P's keys not repeated);
    B. each length bucket (:func:`attention_buckets`) causally against its own keys (a bucket's right padding comes
       after every real key, so the causal rule alone keeps it out of real rows; no mask).
    out = (e^lse_A out_A + e^lse_B out_B) / (e^lse_A + e^lse_B). The backward runs each part's flash-attention
    backward with the merged output and log-sum-exp, which gives each part exactly its share of the whole softmax's
    gradient (the identity ring attention relies on). Nothing of P is copied per continuation."""

    @staticmethod
    def forward(ctx, q_HSD, k_GSD, v_GSD, k_GPD, v_GPD, layout, scale):
        H, S, D = q_HSD.shape
        G = k_GPD.shape[0]
        out_A, lse_A = _FLASH(_SplitAttention._fold(q_HSD, G), k_GPD[None], v_GPD[None], 0.0, False, scale=scale)
        out_B, lse_B = out_A.new_empty(H, S, D), lse_A.new_empty(H, S)
        for b in attention_buckets(layout, 0)[0]:
            o_N, l_N = _FLASH(*_SplitAttention._bucket(q_HSD, k_GSD, v_GSD, b.index), 0.0, True, scale=scale)
            real = b.index < S
            out_B[:, b.index[real]] = o_N.transpose(0, 1)[:, real]
            lse_B[:, b.index[real]] = l_N.transpose(0, 1)[:, real]
        lse_A = lse_A.reshape(H, S)
        lse = torch.logaddexp(lse_A, lse_B)
        out = (out_A.reshape(H, S, D) * (lse_A - lse).exp()[..., None]
               + out_B * (lse_B - lse).exp()[..., None]).to(q_HSD.dtype)  # merged in the log-sum-exp's float32
        ctx.save_for_backward(q_HSD, k_GSD, v_GSD, k_GPD, v_GPD, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    def _fold(x_HSD, G):
        """[H, S, ...] -> [1, G, r * S, ...]: the query heads of each key/value head stacked along the sequence."""
        return x_HSD.reshape((1, G, -1) + x_HSD.shape[2:])

    @staticmethod
    def _bucket(q_HSD, k_GSD, v_GSD, index):
        """A bucket's queries [n, H, L, D] and its own keys and values repeated to the query heads."""
        r = q_HSD.shape[0] // k_GSD.shape[0]
        return (_bucket_rows(q_HSD, index), _bucket_rows(k_GSD, index).repeat_interleave(r, dim=1),
                _bucket_rows(v_GSD, index).repeat_interleave(r, dim=1))

    @staticmethod
    def backward(ctx, d_out):
        q_HSD, k_GSD, v_GSD, k_GPD, v_GPD, out, lse = ctx.saved_tensors
        H, S, D = q_HSD.shape
        G = k_GPD.shape[0]
        d_out = d_out.contiguous()
        fold = partial(_SplitAttention._fold, G=G)
        dq_A, dk_P, dv_P = _FLASH_BACKWARD(fold(d_out), fold(q_HSD), k_GPD[None], v_GPD[None], fold(out),
                                           fold(lse), 0.0, False, scale=ctx.scale)
        dq = dq_A.reshape(H, S, D).to(lse.dtype)  # both parts summed in float32 (bf16 inputs), then cast
        dk, dv = torch.zeros_like(k_GSD), torch.zeros_like(v_GSD)
        for b in attention_buckets(ctx.layout, 0)[0]:
            q_N, k_N, v_N = _SplitAttention._bucket(q_HSD, k_GSD, v_GSD, b.index)
            dq_N, dk_N, dv_N = _FLASH_BACKWARD(_bucket_rows(d_out, b.index), q_N, k_N, v_N,
                                               _bucket_rows(out, b.index), _bucket_rows(lse, b.index), 0.0, True,
                                               scale=ctx.scale)
            n, _, L, _ = dk_N.shape
            real = b.index < S
            cols = b.index[real]
            dq[:, cols] += dq_N.transpose(0, 1)[:, real]
            dk[:, cols] += dk_N.view(n, G, -1, L, D).sum(2).transpose(0, 1)[:, real]
            dv[:, cols] += dv_N.view(n, G, -1, L, D).sum(2).transpose(0, 1)[:, real]
        return dq.to(q_HSD.dtype), dk, dv, dk_P[0], dv_P[0], None, None


def _continuations(q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD, layout: PackLayout, scaling, dropout):
    """The continuations' attention -> [S, H, D]. CPU without attention dropout: :class:`_SplitAttention`.
    Otherwise (dropout: one softmax over P's and their own keys must be dropped as a whole) the length buckets
    (:func:`attention_buckets`), each a right-padded batch against [P's keys ; their own keys] with a mask."""
    if not dropout and _FLASH is not None and q_1HSD.device.type == "cpu":
        parts = (x[0].contiguous() for x in (q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD))
        return _SplitAttention.apply(*parts, layout, scaling).transpose(0, 1)

    def rows(x_1XSD):  # [1, X, S, D] -> [S + 1, X, D]: the continuation region and a zero row for padding
        x_SXD = x_1XSD[0].transpose(0, 1)
        return torch.cat([x_SXD, x_SXD.new_zeros((1,) + x_SXD.shape[1:])])

    q_S, k_S, v_S = rows(q_1HSD), rows(k_1GSD), rows(v_1GSD)
    buckets, unpad = attention_buckets(layout, k_1GPD.shape[2])
    outs = []
    for b in buckets:
        n, L = b.index.shape
        q_N, k_N, v_N = (x[b.index].permute(0, 2, 1, 3) for x in (q_S, k_S, v_S))  # [n, X, L, D]
        keys = torch.cat([k_1GPD.expand(n, -1, -1, -1), k_N], dim=2)
        values = torch.cat([v_1GPD.expand(n, -1, -1, -1), v_N], dim=2)
        out_N = _sdpa(q_N, keys, values, b.mask, scaling, dropout)  # [n, H, L, D]
        outs.append(out_N.permute(0, 2, 1, 3).flatten(0, 1))
    return torch.cat(outs).index_select(0, unpad)  # [S, H, D]


def attention_batched(q_1HTD, k_1GTD, v_1GTD, layout: PackLayout, scaling, dropout, prefix_grad: bool = True):
    """P causally once; the continuations in length buckets against [P's keys ; their own keys].
    ``prefix_grad=False`` (kv_only, where P's outputs get no gradient) runs P's own attention under no_grad."""
    p = layout.prefix_len
    with contextlib.nullcontext() if prefix_grad else torch.no_grad():
        out_P = _sdpa(q_1HTD[:, :, :p], k_1GTD[:, :, :p], v_1GTD[:, :, :p], None, scaling, dropout, is_causal=True)
    out_S = _continuations(q_1HTD[:, :, p:], k_1GTD[:, :, p:], v_1GTD[:, :, p:], k_1GTD[:, :, :p], v_1GTD[:, :, :p],
                           layout, scaling, dropout)
    return torch.cat([out_P[0].transpose(0, 1), out_S])[None].transpose(1, 2)


def attention_flex(q_1HTD, k_1GTD, v_1GTD, layout: PackLayout, scaling, dropout):
    """CUDA: FlexAttention with one BlockMask per pack, built on first use and reused by every layer."""
    from packtrain.kernels import flex

    return flex.flex_attention(q_1HTD, k_1GTD, v_1GTD, layout, scaling, dropout)


_IMPLS = {"dense": attention_dense, "batched": attention_batched, "flex": attention_flex}


# -- frozen context (packing.context_grad=frozen): the buffer holds only the continuations; P's keys and values are
# constants from P's no_grad pass (packtrain.context.PrefixCache).
def frozen_dense(q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD, layout: PackLayout, scaling, dropout):
    """Against [P's keys ; the buffer's keys] with a dense [S, P + S] mask from the predicate (the reference)."""
    p = k_1GPD.shape[2]
    seg = layout.segment_ids
    seg_kv = torch.cat([seg.new_zeros(p), seg])
    q_idx = torch.arange(seg.numel(), device=seg.device) + p
    kv_idx = torch.arange(seg_kv.numel(), device=seg.device)
    allowed = shared_prefix_allowed(seg[:, None], seg_kv[None, :], q_idx[:, None], kv_idx[None, :])
    keys, values = torch.cat([k_1GPD, k_1GSD], dim=2), torch.cat([v_1GPD, v_1GSD], dim=2)
    return _sdpa(q_1HSD, keys, values, allowed[None, None].to(q_1HSD.device), scaling, dropout)


def frozen_batched(q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD, layout: PackLayout, scaling, dropout):
    out_S = _continuations(q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD, layout, scaling, dropout)
    return out_S[None].transpose(1, 2)


def frozen_flex(q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD, layout: PackLayout, scaling, dropout):
    from packtrain.kernels import fla_frozen

    return fla_frozen.flex_attention(q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD, layout, scaling, dropout)


_FROZEN_IMPLS = {"dense": frozen_dense, "batched": frozen_batched, "flex": frozen_flex}


def packtrain_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        packtrain_pack=None, **kwargs):
    """The function transformers calls for every full-attention layer. Returns ([B, T, H, D], None)."""
    if packtrain_pack is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    kind = module.packtrain_backend.attention
    if packtrain_pack.prefix_cache is not None:
        k_P, v_P = packtrain_pack.prefix_cache.kv(module.layer_idx)
        out = _FROZEN_IMPLS[kind](query, key, value, k_P.to(key.dtype), v_P.to(value.dtype), packtrain_pack,
                                  scaling, dropout)
        return out.transpose(1, 2).contiguous(), None
    kwargs = {}
    plan = packtrain_pack.context
    if kind == "batched" and plan is not None and plan.mode == "kv_only":
        kwargs["prefix_grad"] = plan.keep_from[module.layer_idx] < packtrain_pack.prefix_len
    out = _IMPLS[kind](query, key, value, packtrain_pack, scaling, dropout, **kwargs)
    return out.transpose(1, 2).contiguous(), None


__all__ = ["ATTN_NAME", "packtrain_attention", "shared_prefix_allowed"]
