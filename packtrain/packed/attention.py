"""Shared-prefix attention, registered with transformers as the attention implementation ``packtrain``.

The predicate (``layout.shared_prefix_allowed``): P is causal within P; continuation i sees all of P and its own
earlier tokens, nothing of any other continuation. On CPU the continuations' attention runs as two parts merged by
their log-sum-exps (:class:`_SplitAttention`): all continuation queries against P's keys in one call without a
mask, and each length bucket causally against its own keys. Positions are the standalone ones, so RoPE distances from
every continuation to P are exactly those of ``concat(P, Ci)``.

Without a pack under the layout kwarg (a standalone forward), the call goes to transformers' own SDPA attention
with its own causal mask, so the unpacked model computes exactly what it computes as shipped.
Shape legend: H query heads, G key/value heads, T buffer, P prefix, S continuation tokens, N continuations in a
bucket, L the bucket's longest, D head dim.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from packtrain.packed.layout import PackLayout, dense_mask, shared_prefix_allowed

ATTN_NAME = "packtrain"


def _sdpa(q, k, v, mask, scaling, dropout, is_causal=False):
    # enable_gqa: grouped-query attention without materialising the keys/values once per query head
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                          is_causal=is_causal, enable_gqa=k.shape[1] != q.shape[1])


def attention_dense(q_1HTD, k_1GTD, v_1GTD, layout: PackLayout, scaling, dropout, prefix_outputs_grad: bool = True):
    """The whole buffer against a dense [T, T] mask from the predicate: simple, O(T^2) memory; a reference."""
    return _sdpa(q_1HTD, k_1GTD, v_1GTD, dense_mask(layout).to(q_1HTD.device), scaling, dropout)


# Padding cost of a bucket, in query rows: a call's fixed overhead is worth about this many rows on CPU.
_CALL_ROWS = 16


@dataclass
class _Bucket:
    index: torch.Tensor  # [n, L] row of each (continuation, position) in the continuation region, S for padding
    mask: torch.Tensor  # [n, 1, L, P + L] all of P, then causal over the continuation's own real keys


def cheapest_runs(order: list[int], keys: list[int], rows: list[int]) -> list[list[int]]:
    """``order`` (sorted by ``keys``, most first) cut into contiguous runs, one padded attention call each, that
    minimise the padded work: a run's queries (its length x its most ``rows``, plus a call's overhead) times its
    first's ``keys``. Ties go to the longer run."""
    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        most = 0
        for i in range(j - 1, -1, -1):  # the run order[i:j]
            most = max(most, rows[order[i]])
            cost = best[i] + ((j - i) * most + _CALL_ROWS) * keys[order[i]]
            if cost <= best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], len(order)
    while j > 0:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]


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
    device = layout.input_ids.device
    buckets, unpad, row = [], [0] * starts[-1], 0
    for group in cheapest_runs(order, [p + n for n in lens], lens):
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


def _padded(x_S: torch.Tensor) -> torch.Tensor:
    """[S, ...] -> [S + 1, ...]: a zero row at S, where every bucket's padding points."""
    return torch.cat([x_S, x_S.new_zeros((1,) + x_S.shape[1:])])


class _SplitAttention(torch.autograd.Function):
    """The continuations' attention in two parts merged by their log-sum-exps (CPU, no dropout), [S, H, D] rows in
    and out (the flash kernels take and give the heads as strided views of rows, so nothing is transposed):
    A. every continuation query against P's keys in one call and no mask (every query sees all of P);
    B. each length bucket (:func:`attention_buckets`) causally against its own keys (a bucket's right padding comes
       after every real key, so the causal rule alone keeps it out of real rows; no mask). The rows are padded once
       per call and every bucket gathers its [n, L] rows from them; the buckets' outputs come back to the
       continuations' order through one gather (the buckets partition the rows).
    out = (e^lse_A out_A + e^lse_B out_B) / (e^lse_A + e^lse_B). The backward runs each part's flash-attention
    backward with the merged output and log-sum-exp, which gives each part exactly its share of the whole softmax's
    gradient (the identity ring attention relies on). Keys and values are repeated to the query heads (the kernel
    has no grouped-query form), P's once per call, not per continuation."""

    @staticmethod
    def forward(ctx, q_SHD, k_SGD, v_SGD, k_PGD, v_PGD, layout, scale):
        r = q_SHD.shape[1] // k_SGD.shape[1]
        heads = _SplitAttention._heads
        out_A, lse_A = _FLASH(heads(q_SHD[None]), heads(k_PGD[None], r), heads(v_PGD[None], r), 0.0, False,
                              scale=scale)
        buckets, unpad = attention_buckets(layout, 0)
        rows = [_padded(x) for x in (q_SHD, k_SGD.repeat_interleave(r, dim=1), v_SGD.repeat_interleave(r, dim=1))]
        parts = [_FLASH(*(heads(x[b.index]) for x in rows), 0.0, True, scale=scale) for b in buckets]
        out_B, lse_B = (_SplitAttention._unbucket([p[i] for p in parts], unpad) for i in (0, 1))
        lse_A = _SplitAttention._rows(lse_A)
        lse = torch.logaddexp(lse_A, lse_B)  # [S, H]
        out = (_SplitAttention._rows(out_A) * (lse_A - lse).exp()[..., None]
               + out_B * (lse_B - lse).exp()[..., None]).to(q_SHD.dtype)  # merged in the log-sum-exp's float32
        ctx.save_for_backward(q_SHD, k_SGD, v_SGD, k_PGD, v_PGD, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    def _heads(x_BLXD, r=1):
        """[B, L, X, ...] rows -> the kernel's [B, X * r, L, ...], a strided view unless the heads are repeated."""
        return (x_BLXD.repeat_interleave(r, dim=2) if r > 1 else x_BLXD).transpose(1, 2)

    @staticmethod
    def _rows(x_BHL):
        """The kernel's [B, H, L, ...] (rows in memory) -> [B * L, H, ...]."""
        return x_BHL.transpose(1, 2).flatten(0, 1)

    @staticmethod
    def _unbucket(per_bucket, unpad):
        """The buckets' [n, H, L, ...] results -> [S, H, ...] in the continuations' order."""
        return torch.cat([_SplitAttention._rows(x) for x in per_bucket]).index_select(0, unpad)

    @staticmethod
    def backward(ctx, d_out):
        q_SHD, k_SGD, v_SGD, k_PGD, v_PGD, out, lse = ctx.saved_tensors
        _, H, D = q_SHD.shape
        G = k_PGD.shape[1]
        r = H // G
        heads, rows_of, unbucket = _SplitAttention._heads, _SplitAttention._rows, _SplitAttention._unbucket
        whole = (heads(d_out[None]), heads(q_SHD[None]), heads(k_PGD[None], r), heads(v_PGD[None], r),
                 heads(out[None]), heads(lse[None]))
        dq_A, dk_P, dv_P = _FLASH_BACKWARD(*whole, 0.0, False, scale=ctx.scale)
        buckets, unpad = attention_buckets(ctx.layout, 0)
        rows = [_padded(x) for x in (d_out, q_SHD, k_SGD.repeat_interleave(r, dim=1),
                                     v_SGD.repeat_interleave(r, dim=1), out, lse)]
        parts = [_FLASH_BACKWARD(*(heads(x[b.index]) for x in rows), 0.0, True, scale=ctx.scale)[:3]
                 for b in buckets]
        dq_B, dk_B, dv_B = (unbucket([p[i] for p in parts], unpad) for i in range(3))
        dq = (rows_of(dq_A).to(lse.dtype) + dq_B).to(q_SHD.dtype)  # both parts summed in float32 (bf16 inputs)

        def per_group(d_XHD):  # the repeated heads' gradients summed back to their key/value head
            return d_XHD.reshape(d_XHD.shape[0], G, r, D).sum(2)

        return (dq, per_group(dk_B), per_group(dv_B), per_group(rows_of(dk_P)), per_group(rows_of(dv_P)), None, None)


def _continuations(q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD, layout: PackLayout, scaling, dropout):
    """The continuations' attention -> [S, H, D]. CPU without attention dropout: :class:`_SplitAttention`.
    Otherwise (dropout: one softmax over P's and their own keys must be dropped as a whole) the length buckets
    (:func:`attention_buckets`), each a right-padded batch against [P's keys ; their own keys] with a mask."""
    if not dropout and _FLASH is not None and q_1HSD.device.type == "cpu":
        # [S, X, D] rows: a view for v (the projection's rows); q and k come from RoPE as [H, T, D] and are copied
        parts = (x[0].transpose(0, 1).contiguous() for x in (q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD))
        return _SplitAttention.apply(*parts, layout, scaling)

    # [1, X, S, D] -> [S + 1, X, D]: the continuation region's rows and a zero row for padding
    q_S, k_S, v_S = (_padded(x[0].transpose(0, 1)) for x in (q_1HSD, k_1GSD, v_1GSD))
    buckets, unpad = attention_buckets(layout, k_1GPD.shape[2])
    outs = []
    for b in buckets:
        n = b.index.shape[0]
        q_N, k_N, v_N = (x[b.index].permute(0, 2, 1, 3) for x in (q_S, k_S, v_S))  # [n, X, L, D]
        keys = torch.cat([k_1GPD.expand(n, -1, -1, -1), k_N], dim=2)
        values = torch.cat([v_1GPD.expand(n, -1, -1, -1), v_N], dim=2)
        out_N = _sdpa(q_N, keys, values, b.mask, scaling, dropout)  # [n, H, L, D]
        outs.append(out_N.permute(0, 2, 1, 3).flatten(0, 1))
    return torch.cat(outs).index_select(0, unpad)  # [S, H, D]


def attention_batched(q_1HTD, k_1GTD, v_1GTD, layout: PackLayout, scaling, dropout, prefix_outputs_grad: bool = True):
    """P causally once; the continuations in length buckets against [P's keys ; their own keys].
    ``prefix_outputs_grad=False`` (kv_only, where P's outputs get no gradient) runs P's own attention under no_grad."""
    p = layout.prefix_len
    with contextlib.nullcontext() if prefix_outputs_grad else torch.no_grad():
        out_P = _sdpa(q_1HTD[:, :, :p], k_1GTD[:, :, :p], v_1GTD[:, :, :p], None, scaling, dropout, is_causal=True)
    out_S = _continuations(q_1HTD[:, :, p:], k_1GTD[:, :, p:], v_1GTD[:, :, p:], k_1GTD[:, :, :p], v_1GTD[:, :, :p],
                           layout, scaling, dropout)
    return torch.cat([out_P[0].transpose(0, 1), out_S])[None].transpose(1, 2)


def attention_flex(q_1HTD, k_1GTD, v_1GTD, layout: PackLayout, scaling, dropout, prefix_outputs_grad: bool = True):
    """CUDA: FlexAttention with one BlockMask per pack, built on first use and reused by every layer."""
    from packtrain.packed.kernels import flex

    return flex.flex_attention(q_1HTD, k_1GTD, v_1GTD, layout, scaling, dropout)



# -- frozen context (packing.context_grad=frozen): the buffer holds only the continuations; P's keys and values are
# constants from P's no_grad pass (packtrain.packed.prefix.PrefixState).
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
    from packtrain.packed.kernels import fla_frozen

    return fla_frozen.flex_attention(q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD, layout, scaling, dropout)



def pack_attention(module, query, key, value, layout: PackLayout, scaling, dropout, prefix=None,
                   keep_from: tuple[int, ...] | None = None) -> torch.Tensor:
    """A full-attention layer on a pack's buffer in the back end's kind: [1, H, T, D]. ``prefix``
    (:class:`~packtrain.packed.prefix.PrefixState`): P's keys and values from outside, the buffer holds only the
    continuations; ``keep_from`` (kv_only): P's own attention runs under no_grad in the layers where P's outputs
    get no gradient."""
    kernels = module.packtrain_kernels  # the back end's, picked once (packtrain.packed.patch.pick_kernels)
    if prefix is not None:
        k_P, v_P = prefix.keys_values(module.layer_idx)
        return kernels.frozen_attention(query, key, value, k_P.to(key.dtype), v_P.to(value.dtype), layout, scaling,
                                        dropout)
    prefix_outputs_grad = keep_from is None or keep_from[module.layer_idx] < layout.prefix_len
    return kernels.attention(query, key, value, layout, scaling, dropout, prefix_outputs_grad)


def packtrain_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        packtrain_pack=None, **kwargs):
    """The function transformers calls for every full-attention layer. Returns ([B, T, H, D], None).
    ``packtrain_pack``: what the layers read under the layout kwarg (a pack's
    :class:`~packtrain.packed.pack_pass.PackPass`, or a generation's decoding
    :class:`~packtrain.packed.rows.Rows`), which runs the layer itself; None: a standalone forward, SDPA."""
    if packtrain_pack is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    out = packtrain_pack.attention(module, query, key, value, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


__all__ = ["ATTN_NAME", "packtrain_attention", "shared_prefix_allowed"]
