"""fla's Triton kernels for the packed Gated DeltaNet. Imported only when ``model.kernels`` selects fla (CUDA, or
CPU under Triton's interpreter: packtrain/packed/kernels/interpreter.py).

- Conv-tail replay without an initial-state conv: each continuation is laid out as [P's last W-1 conv inputs ;
  its own tokens] (a prefix tree's node: [its path's last W-1 ; its own]) in one varlen buffer, fla's
  ``causal_conv1d`` runs over it with ``cu_seqlens`` (so segments never read each other), and the W-1 warm-up
  outputs are dropped. The tail is a gather from P's rows, so its gradient sums back into P.
- The delta rule: P once from the zero state (``output_final_state``), then every continuation in one varlen
  call with ``cu_seqlens`` and ``initial_state`` = P's state expanded to [N, HV, K, V] (fla returns dh0, which
  the expand sums into P's state).
- A prefix tree's delta rule (:func:`delta_rule`): one varlen call per tree level, every node from its parent's
  final state (:func:`packtrain.packed.tree.tree_delta_rule`).
Tested against the torch back end by ``tests/packed/kernels/test_gpu.py`` (skipped without CUDA) and
``tools/gpu_check.sh``.
"""

from __future__ import annotations

import torch
from fla.modules.causal_conv1d import causal_conv1d
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

from packtrain.packed.layout import PackLayout


def _conv(x_1TC, weight_CW, bias_C, cu_seqlens=None):
    out = causal_conv1d(x=x_1TC, weight=weight_CW, bias=bias_C, activation="silu", cu_seqlens=cu_seqlens)
    return out[0] if isinstance(out, tuple) else out


def _tailed_index(layout: PackLayout, width: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices into [zero ; buffer] laying out every segment after P behind its own history
    (``layout.conv_histories``: [tail ; C1 ; tail ; C2 ; ...] for a pack, each node behind its path's last W-1 rows
    for a prefix tree), its cu_seqlens, and the rows of the result that are real (non-warm-up) outputs. Built once
    per pack and width."""
    key = ("tailed", width)
    if key not in layout._cache:
        gather, keep, cu = [], [], [0]
        for history, start, end in layout.conv_histories(width)[1:]:
            gather.extend(r + 1 for r in history)  # +1: row 0 is a zero row (a history shorter than W-1)
            keep.extend(range(len(gather), len(gather) + end - start))
            gather.extend(range(start + 1, end + 1))
            cu.append(len(gather))
        layout._cache[key] = tuple(torch.tensor(v, device=device, dtype=dt) for v, dt in
                                   ((gather, torch.long), (cu, torch.long), (keep, torch.long)))
    return layout._cache[key]


def packed_conv(mixed_TC, weight_CW, bias_C, layout: PackLayout) -> torch.Tensor:
    p, W = layout.prefix_len, weight_CW.shape[-1]
    out_P = _conv(mixed_TC[None, :p], weight_CW, bias_C)[0]
    gather, cu, keep = _tailed_index(layout, W, mixed_TC.device)
    padded = torch.cat([mixed_TC.new_zeros(1, mixed_TC.shape[1]), mixed_TC])[gather]
    out_C = _conv(padded[None], weight_CW, bias_C, cu_seqlens=cu)[0][keep]
    return torch.cat([out_P, out_C])


def packed_delta_rule(q_THK, k_THK, v_THV, g_TH, beta_TH, layout: PackLayout) -> torch.Tensor:
    p = layout.prefix_len
    out_P, state = chunk_gated_delta_rule(q_THK[None, :p], k_THK[None, :p], v_THV[None, :p], g_TH[None, :p],
                                          beta_TH[None, :p], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
    n = len(layout.cont_lens)
    cu = layout.cu_seqlens.to(device=q_THK.device, dtype=torch.long)
    out_C, _ = chunk_gated_delta_rule(q_THK[None, p:], k_THK[None, p:], v_THV[None, p:], g_TH[None, p:],
                                      beta_TH[None, p:], initial_state=state.expand(n, -1, -1, -1).contiguous(),
                                      output_final_state=False, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    return torch.cat([out_P[0], out_C[0]]).to(q_THK.dtype)


def delta_rule(q_1SHK, k_1SHK, v_1SHV, g_1SH, beta_1SH, initial_state=None, lengths=None):
    """fla's chunk rule on [1, S, ...] with every sequence's final state: from the zero state (``lengths`` None),
    or varlen (``cu_seqlens`` from ``lengths``) from per-sequence ``initial_state`` [N, HV, K, V] (a prefix tree's
    level, :func:`packtrain.packed.tree.tree_delta_rule`; fla returns dh0, which the gather of the parents' states
    sums). (output [1, S, HV, V], final states [N, HV, K, V] float32)."""
    kwargs = {}
    if lengths is not None:
        cu = torch.tensor([0] + list(lengths), device=q_1SHK.device).cumsum(0)
        kwargs = {"initial_state": initial_state.contiguous(), "cu_seqlens": cu}
    return chunk_gated_delta_rule(q_1SHK, k_1SHK, v_1SHV, g_1SH, beta_1SH, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, **kwargs)
