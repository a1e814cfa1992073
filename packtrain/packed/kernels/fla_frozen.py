"""CUDA back end for a buffer that holds only the continuations, with P's attention K/V and final Gated DeltaNet state
from outside: constants from P's no_grad pass under ``packing.context_grad=frozen``, leaves that collect the gradient
in continuation groups. (The conv reuses :func:`fla_backend.packed_conv` on [P's tail ; continuations], see
:func:`packtrain.packed.gdn._tail_layout`.) Imported only when ``model.kernels`` is fla.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from packtrain.packed.kernels.fla_backend import continuations_from_state
from packtrain.packed.kernels.flex import FLEX_BLOCK, _compiled_flex, _mark_block_dims_dynamic, padded_length
from packtrain.packed.layout import PackLayout, shared_prefix_allowed


def continuation_delta_rule(heads, conv_SC, b_S, a_S, layout: PackLayout, state, final_state=False):
    """Every continuation from P's final state [1, HV, K, V] (float32: transformers keeps what fla returned),
    expanded per continuation, in varlen calls of :data:`~packtrain.packed.kernels.fla_backend.CALL_ROWS` rows
    (``heads``: :func:`~packtrain.packed.kernels.fla_backend.continuations_from_state`'s). With ``final_state``:
    (output, each continuation's final state [N, HV, K, V])."""
    out = continuations_from_state(heads, conv_SC, b_S, a_S, layout.cont_lens, state, final_state,
                                   layout._cache)
    if final_state:
        return out[0].to(conv_SC.dtype), out[1]
    return out.to(conv_SC.dtype)


def _block_mask(layout: PackLayout, p: int, device):
    """Queries are the continuation rows, keys [P ; continuations]; both padded to whole FlexAttention blocks with
    segment -1 rows and the block dimensions marked dynamic, as :func:`packtrain.packed.kernels.flex.block_mask` does, so
    one compilation serves every pack (P's length is a tensor for the same reason)."""
    key = ("frozen_block_mask", p)
    if key not in layout._cache:
        S = layout.segment_ids.numel()
        Sq, Skv = padded_length(S), padded_length(p + S)
        seg_C = layout.segment_ids.to(device)
        seg = F.pad(seg_C, (0, Sq - S), value=-1)
        seg_kv = F.pad(torch.cat([seg_C.new_zeros(p), seg_C]), (0, Skv - p - S), value=-1)
        offset = torch.tensor(p, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            return shared_prefix_allowed(seg[q_idx], seg_kv[kv_idx], q_idx + offset, kv_idx)

        bm = create_block_mask(mask_mod, 1, None, Sq, Skv, device=device, BLOCK_SIZE=FLEX_BLOCK,
                               _compile=Skv > 8192)
        _mark_block_dims_dynamic(bm)
        layout._cache[key] = bm
    return layout._cache[key]


def flex_attention(q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD, layout: PackLayout, scaling, dropout):
    if dropout:
        raise ValueError("FlexAttention path: attention dropout is not supported (Qwen3.5 uses none)")
    S, p = q_1HSD.shape[2], k_1GPD.shape[2]
    bm = _block_mask(layout, p, q_1HSD.device)
    keys, values = torch.cat([k_1GPD, k_1GSD], dim=2), torch.cat([v_1GPD, v_1GSD], dim=2)
    kv_pad = (0, 0, 0, padded_length(p + S) - p - S)
    q = F.pad(q_1HSD, (0, 0, 0, padded_length(S) - S))
    out = _compiled_flex(q, F.pad(keys, kv_pad), F.pad(values, kv_pad), block_mask=bm, scale=scaling,
                         enable_gqa=keys.shape[1] != q_1HSD.shape[1])
    return out[:, :, :S]
