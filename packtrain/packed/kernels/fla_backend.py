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

import itertools

import torch
from fla.modules.causal_conv1d import causal_conv1d
from fla.ops.gated_delta_rule import chunk_gated_delta_rule

from packtrain.packed.layout import PackLayout


def varlen_bounds(cache: dict, key, lengths: list[int], device) -> dict[str, torch.Tensor]:
    """fla's varlen bounds of sequences of ``lengths``, built once per layout (``cache``: its ``_cache``) and reused
    by every layer: ``cu_seqlens`` int64 on the device and ``cu_seqlens_cpu``, its host copy. Without the host copy
    each varlen call of fla reads the bounds back from the device (a sync per call: about 190 per pack at the 27B),
    and a new tensor per call never hits fla's own cache of what it derives from them."""
    key = ("varlen", key, str(device))
    if key not in cache:
        cpu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long)
        cache[key] = {"cu_seqlens": cpu.to(device), "cu_seqlens_cpu": cpu}
    return cache[key]


def _conv(x_1TC, weight_CW, bias_C, **bounds):
    out = causal_conv1d(x=x_1TC, weight=weight_CW, bias=bias_C, activation="silu", **bounds)
    return out[0] if isinstance(out, tuple) else out


def _tailed_index(layout: PackLayout, width: int, device) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Indices into [zero ; buffer] laying out every segment after P behind its own history
    (``layout.conv_histories``: [tail ; C1 ; tail ; C2 ; ...] for a pack, each node behind its path's last W-1 rows
    for a prefix tree), its varlen bounds (:func:`varlen_bounds`), and the rows of the result that are real
    (non-warm-up) outputs. Built once per pack and width."""
    key = ("tailed", width)
    if key not in layout._cache:
        gather, keep, lengths = [], [], []
        for history, start, end in layout.conv_histories(width)[1:]:
            gather.extend(r + 1 for r in history)  # +1: row 0 is a zero row (a history shorter than W-1)
            keep.extend(range(len(gather), len(gather) + end - start))
            gather.extend(range(start + 1, end + 1))
            lengths.append(len(history) + end - start)
        bounds = varlen_bounds(layout._cache, ("tailed", width), lengths, device)
        layout._cache[key] = (torch.tensor(gather, device=device, dtype=torch.long), bounds,
                              torch.tensor(keep, device=device, dtype=torch.long))
    return layout._cache[key]


def packed_conv(mixed_TC, weight_CW, bias_C, layout: PackLayout) -> torch.Tensor:
    p, W = layout.prefix_len, weight_CW.shape[-1]
    out_P = _conv(mixed_TC[None, :p], weight_CW, bias_C)[0]
    gather, bounds, keep = _tailed_index(layout, W, mixed_TC.device)
    padded = torch.cat([mixed_TC.new_zeros(1, mixed_TC.shape[1]), mixed_TC])[gather]
    out_C = _conv(padded[None], weight_CW, bias_C, **bounds)[0][keep]
    return torch.cat([out_P, out_C])


def packed_delta_rule(q_THK, k_THK, v_THV, g_TH, beta_TH, layout: PackLayout) -> torch.Tensor:
    p = layout.prefix_len
    out_P, state = chunk_gated_delta_rule(q_THK[None, :p], k_THK[None, :p], v_THV[None, :p], g_TH[None, :p],
                                          beta_TH[None, :p], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
    n = len(layout.cont_lens)
    bounds = varlen_bounds(layout._cache, "continuations", layout.cont_lens, q_THK.device)
    out_C, _ = chunk_gated_delta_rule(q_THK[None, p:], k_THK[None, p:], v_THV[None, p:], g_TH[None, p:],
                                      beta_TH[None, p:], initial_state=state.expand(n, -1, -1, -1).contiguous(),
                                      output_final_state=False, use_qk_l2norm_in_kernel=True, **bounds)
    return torch.cat([out_P[0], out_C[0]]).to(q_THK.dtype)


def delta_rule(q_1SHK, k_1SHK, v_1SHV, g_1SH, beta_1SH, initial_state=None, lengths=None, cache=None, key=None):
    """fla's chunk rule on [1, S, ...] with every sequence's final state: from the zero state (``lengths`` None),
    or varlen (bounds from ``lengths``, kept in ``cache`` under ``key``: :func:`varlen_bounds`) from per-sequence
    ``initial_state`` [N, HV, K, V] (a prefix tree's level, :func:`packtrain.packed.tree.tree_delta_rule`; fla
    returns dh0, which the gather of the parents' states sums). (output [1, S, HV, V], final states [N, HV, K, V]
    float32)."""
    kwargs = {}
    if lengths is not None:
        kwargs = {"initial_state": initial_state.contiguous(),
                  **varlen_bounds({} if cache is None else cache, key, lengths, q_1SHK.device)}
    return chunk_gated_delta_rule(q_1SHK, k_1SHK, v_1SHV, g_1SH, beta_1SH, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, **kwargs)
