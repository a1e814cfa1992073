"""fla's Triton kernels for the packed Gated DeltaNet. Imported only when ``model.kernels`` selects fla (CUDA, or
CPU under Triton's interpreter: packtrain/packed/kernels/interpreter.py).

- Conv-tail replay without an initial-state conv: each continuation is laid out as [P's last W-1 conv inputs ;
  its own tokens] (a prefix tree's node: [its path's last W-1 ; its own]) in one varlen buffer, fla's
  ``causal_conv1d`` runs over it with ``cu_seqlens`` (so segments never read each other), and the W-1 warm-up
  outputs are dropped. The tail is a gather from P's rows, so its gradient sums back into P (in a fixed order:
  :func:`packtrain.packed.gather.gather_rows`).
- The delta rule: P once from the zero state (``output_final_state``), then the continuations in varlen calls with
  ``cu_seqlens`` and ``initial_state`` = P's state expanded to [N, HV, K, V] (fla returns dh0, which the expand
  sums into P's state), whole continuations of at most :data:`CALL_ROWS` rows per call: fla's backward makes
  about 130 KB per row at Qwen3.6's widths (w, u, chunk states and their gradients), so one call over a pack's
  300K continuation rows would hold 40 GiB where calls of 64K hold 8, each call's backward after the other's.
  Every continuation computes alone in any grouping.
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

from packtrain.packed.gather import gather_rows
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
    out_P = _conv(mixed_TC[None, :p], weight_CW, bias_C).squeeze(0)  # a view: its gradient is not copied
    gather, bounds, keep = _tailed_index(layout, W, mixed_TC.device)
    # P's tail is read once per continuation: its gradient summed in a fixed order (CUDA's index_put_ adds them
    # atomically, in another order on every run; packtrain/packed/gather.py)
    padded = gather_rows(torch.cat([mixed_TC.new_zeros(1, mixed_TC.shape[1]), mixed_TC]), gather)
    out_C = _conv(padded[None], weight_CW, bias_C, **bounds).squeeze(0)[keep]
    return torch.cat([out_P, out_C])


# The most rows of continuations one varlen call of the delta rule takes (whole continuations; one longer than this
# goes alone): its backward's workspace is per row of the call (memory.gdn_kernel_terms)
CALL_ROWS = 65_536


def call_groups(lengths, rows: int | None = None) -> list[tuple[int, int]]:
    """[first, end) continuation indices of each call: consecutive continuations of at most ``rows`` rows
    (:data:`CALL_ROWS`) together, at least one per call."""
    rows = CALL_ROWS if rows is None else rows
    groups, first, held = [], 0, 0
    for i, n in enumerate(lengths):
        if i > first and held + n > rows:
            groups.append((first, i))
            first, held = i, 0
        held += n
    if lengths:
        groups.append((first, len(lengths)))
    return groups


def _row_pieces(tensors, sizes) -> list[tuple]:
    """One split per tensor into ``sizes`` rows: its backward concatenates the pieces' gradients once (a slice per
    piece would make a zero-filled gradient of the whole tensor per piece)."""
    return list(zip(*(t.split(sizes) for t in tensors)))


def _continuation_calls(heads, pieces, groups, lengths, cache, state, final_state: bool):
    """The delta rule of each call's continuations from ``state`` [1, HV, K, V]: (outputs, final states). Each
    call's varlen bounds are built once per layout (``cache``, :func:`varlen_bounds`)."""
    outs, finals = [], []
    for (first, end), (conv, b, a) in zip(groups, pieces):
        q, k, v, g, beta = heads(conv, b, a)
        bounds = varlen_bounds(cache, ("continuations", first, end), lengths[first:end], conv.device)
        out, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                            initial_state=state.expand(end - first, -1, -1, -1).contiguous(),
                                            output_final_state=final_state, use_qk_l2norm_in_kernel=True,
                                            **bounds)
        outs.append(out.squeeze(0))  # a view (out[0]'s backward would copy the gradient)
        finals.append(final)
    return outs, finals


def _calls(lengths):
    bounds = [0, *itertools.accumulate(lengths)]
    groups = call_groups(lengths)
    return groups, [bounds[end] - bounds[first] for first, end in groups]


def continuations_from_state(heads, conv_SC, b_S, a_S, lengths, state, final_state: bool = False, cache=None):
    """Every continuation (``lengths``, laid end to end in the conv's output [S, C] and the gates' inputs [S, HV])
    from the state [1, HV, K, V], in calls of :data:`CALL_ROWS` rows; ``heads(conv, b, a)`` splits a call's rows into
    (q, k, v, g, beta) (packtrain/packed/gdn.py's ``gdn_heads``): the rows are split before the heads, so in
    backward each call's q/k/v gradients join into its rows of the conv's gradient as soon as its call is done.
    ``cache``: the layout's ``_cache``, where the calls' varlen bounds are kept (None: built for this call).
    Returns the output [S, HV, V] and, with ``final_state``, each continuation's final state [N, HV, K, V]."""
    groups, sizes = _calls(lengths)
    outs, finals = _continuation_calls(heads, _row_pieces((conv_SC, b_S, a_S), sizes), groups, lengths,
                                       {} if cache is None else cache, state, final_state)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if not final_state:
        return out
    return out, finals[0] if len(finals) == 1 else torch.cat(finals)


def packed_delta_rule(heads, conv_TC, b_TH, a_TH, layout: PackLayout) -> torch.Tensor:
    """P from the zero state, then the continuations from P's final state (:func:`continuations_from_state`); the
    conv's output and the gates split into P's rows and each call's in one split."""
    p = layout.prefix_len
    groups, sizes = _calls(layout.cont_lens)
    (conv_P, b_P, a_P), *pieces = _row_pieces((conv_TC, b_TH, a_TH), [p, *sizes])
    q, k, v, g, beta = heads(conv_P, b_P, a_P)
    out_P, state = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
    outs, _ = _continuation_calls(heads, pieces, groups, layout.cont_lens, layout._cache, state, False)
    return torch.cat([out_P.squeeze(0), *outs]).to(conv_TC.dtype)


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
