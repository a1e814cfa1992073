"""Shared-prefix attention, registered with transformers as the attention implementation ``packtrain``.

The predicate (``layout.shared_prefix_allowed``): P is causal within P; continuation i sees all of P and its own
earlier tokens, nothing of any other continuation. Positions are the standalone ones, so RoPE distances from
every continuation to P are exactly those of ``concat(P, Ci)``.

Without a pack layout in the call (a standalone forward), the call goes to transformers' own SDPA attention
with its own causal mask, so the unpacked model computes exactly what it computes as shipped.
Shape legend: H query heads, G key/value heads, T buffer, P prefix, N continuations, L longest, D head dim.
"""

from __future__ import annotations

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


def attention_batched(q_1HTD, k_1GTD, v_1GTD, layout: PackLayout, scaling, dropout):
    """P causally once; the continuations as one right-padded batch against [P's keys ; their own keys]."""
    p = layout.prefix_len
    out_P = _sdpa(q_1HTD[:, :, :p], k_1GTD[:, :, :p], v_1GTD[:, :, :p], None, scaling, dropout, is_causal=True)

    def pad(x_1XTD):  # [1, X, T, D] -> [N, X, L, D] over the continuation region
        x_SXD = x_1XTD[0, :, p:].transpose(0, 1)
        x_SXD = torch.cat([x_SXD, x_SXD.new_zeros((1,) + x_SXD.shape[1:])])
        return x_SXD[layout.pad_index].permute(0, 2, 1, 3)

    q_N, k_N, v_N = pad(q_1HTD), pad(k_1GTD), pad(v_1GTD)
    n, L = layout.pad_index.shape
    keys = torch.cat([k_1GTD[:, :, :p].expand(n, -1, -1, -1), k_N], dim=2)
    values = torch.cat([v_1GTD[:, :, :p].expand(n, -1, -1, -1), v_N], dim=2)
    idx = torch.arange(L, device=q_1HTD.device)
    own = (idx[None, :] <= idx[:, None])[None] & layout.valid[:, None, :]  # [N, L, L], causal and real keys
    mask = torch.cat([own.new_ones(n, L, p), own], dim=2)[:, None]  # every query sees all of P
    out_N = _sdpa(q_N, keys, values, mask, scaling, dropout)  # [N, H, L, D]
    out_S = out_N.permute(0, 2, 1, 3).flatten(0, 1)[layout.unpad_index]  # [S, H, D]
    return torch.cat([out_P[0].transpose(0, 1), out_S])[None].transpose(1, 2)


def attention_flex(q_1HTD, k_1GTD, v_1GTD, layout: PackLayout, scaling, dropout):
    """CUDA: FlexAttention with one BlockMask per pack, built on first use and reused by every layer."""
    from packtrain.kernels import flex

    return flex.flex_attention(q_1HTD, k_1GTD, v_1GTD, layout, scaling, dropout)


_IMPLS = {"dense": attention_dense, "batched": attention_batched, "flex": attention_flex}


def packtrain_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        packtrain_pack=None, **kwargs):
    """The function transformers calls for every full-attention layer. Returns ([B, T, H, D], None)."""
    if packtrain_pack is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    impl = _IMPLS[module.packtrain_backend.attention]
    out = impl(query, key, value, packtrain_pack, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


__all__ = ["ATTN_NAME", "packtrain_attention", "shared_prefix_allowed"]
