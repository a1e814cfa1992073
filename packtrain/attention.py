"""Shared-prefix attention, registered with transformers as the attention implementation ``packtrain``.

The predicate (``layout.shared_prefix_allowed``): P is causal within P; continuation i sees all of P and its own
earlier tokens, nothing of any other continuation. Positions are the standalone ones, so RoPE distances from
every continuation to P are exactly those of ``concat(P, Ci)``.

Without a pack layout in the call (a standalone forward), the call goes to transformers' own SDPA attention
with its own causal mask, so the unpacked model computes exactly what it computes as shipped.
Shape legend: H query heads, G key/value heads, T buffer, P prefix, N continuations, L longest, D head dim.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from packtrain.layout import PackLayout, dense_mask, shared_prefix_allowed

ATTN_NAME = "packtrain"


def _sdpa(q, k, v, mask, scaling, dropout, is_causal=False):
    if k.shape[1] != q.shape[1]:  # grouped-query attention: expand keys/values to every query head
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                          is_causal=is_causal)


def attention_dense(q_1HTD, k_1GTD, v_1GTD, layout: PackLayout, scaling, dropout):
    """The whole buffer against a dense [T, T] mask from the predicate: simple, O(T^2) memory; a reference."""
    return _sdpa(q_1HTD, k_1GTD, v_1GTD, dense_mask(layout).to(q_1HTD.device), scaling, dropout)


def _continuations(q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD, layout: PackLayout, scaling, dropout):
    """The continuations as one right-padded batch against [P's keys ; their own keys] -> [S, H, D]."""
    def pad(x_1XSD):  # [1, X, S, D] -> [N, X, L, D]
        x_SXD = x_1XSD[0].transpose(0, 1)
        x_SXD = torch.cat([x_SXD, x_SXD.new_zeros((1,) + x_SXD.shape[1:])])
        return x_SXD[layout.pad_index].permute(0, 2, 1, 3)

    q_N, k_N, v_N = pad(q_1HSD), pad(k_1GSD), pad(v_1GSD)
    n, L = layout.pad_index.shape
    p = k_1GPD.shape[2]
    keys = torch.cat([k_1GPD.expand(n, -1, -1, -1), k_N], dim=2)
    values = torch.cat([v_1GPD.expand(n, -1, -1, -1), v_N], dim=2)
    idx = torch.arange(L, device=q_1HSD.device)
    own = (idx[None, :] <= idx[:, None])[None] & layout.valid[:, None, :]  # [N, L, L], causal and real keys
    mask = torch.cat([own.new_ones(n, L, p), own], dim=2)[:, None]  # every query sees all of P
    out_N = _sdpa(q_N, keys, values, mask, scaling, dropout)  # [N, H, L, D]
    return out_N.permute(0, 2, 1, 3).flatten(0, 1)[layout.unpad_index]  # [S, H, D]


def attention_batched(q_1HTD, k_1GTD, v_1GTD, layout: PackLayout, scaling, dropout, prefix_grad: bool = True):
    """P causally once; the continuations as one right-padded batch against [P's keys ; their own keys].
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
