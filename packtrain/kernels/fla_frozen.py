"""CUDA back end for ``packing.context_grad=frozen``: the buffer holds only the continuations, P's attention K/V and
final Gated DeltaNet state are constants from P's no_grad pass. (The conv reuses :func:`fla_backend.packed_conv` on
[P's tail ; continuations], see :func:`packtrain.gdn._tail_layout`.) Imported only when ``model.kernels`` is fla.
"""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from torch.nn.attention.flex_attention import create_block_mask

from packtrain.kernels.fla_backend import _compiled_flex
from packtrain.layout import PackLayout, shared_prefix_allowed


def continuation_delta_rule(q_SHK, k_SHK, v_SHV, g_SH, beta_SH, layout: PackLayout, state) -> torch.Tensor:
    """Every continuation in one varlen call from P's final state [1, HV, K, V] (expanded per continuation)."""
    n = len(layout.cont_lens)
    cu = layout.cu_seqlens.to(device=q_SHK.device, dtype=torch.long)
    initial = state.expand(n, -1, -1, -1).contiguous()  # float32: transformers keeps what fla returned
    out, _ = chunk_gated_delta_rule(q_SHK[None], k_SHK[None], v_SHV[None], g_SH[None], beta_SH[None],
                                    initial_state=initial, output_final_state=False, use_qk_l2norm_in_kernel=True,
                                    cu_seqlens=cu)
    return out[0].to(q_SHK.dtype)


def _block_mask(layout: PackLayout, p: int, device):
    if "frozen_block_mask" not in layout._cache:
        seg = layout.segment_ids.to(device)
        seg_kv = torch.cat([seg.new_zeros(p), seg])

        def mask_mod(b, h, q_idx, kv_idx):  # queries are the continuation rows, keys [P ; continuations]
            return shared_prefix_allowed(seg[q_idx], seg_kv[kv_idx], q_idx + p, kv_idx)

        S = seg.numel()
        layout._cache["frozen_block_mask"] = create_block_mask(mask_mod, 1, None, S, p + S, device=device,
                                                               _compile=p + S > 8192)
    return layout._cache["frozen_block_mask"]


def flex_attention(q_1HSD, k_1GSD, v_1GSD, k_1GPD, v_1GPD, layout: PackLayout, scaling, dropout):
    if dropout:
        raise ValueError("FlexAttention path: attention dropout is not supported (Qwen3.5 uses none)")
    bm = _block_mask(layout, k_1GPD.shape[2], q_1HSD.device)
    keys, values = torch.cat([k_1GPD, k_1GSD], dim=2), torch.cat([v_1GPD, v_1GSD], dim=2)
    return _compiled_flex(q_1HSD, keys, values, block_mask=bm, scale=scaling,
                          enable_gqa=keys.shape[1] != q_1HSD.shape[1])
