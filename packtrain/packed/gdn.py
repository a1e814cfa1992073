"""Gated DeltaNet on a packed buffer: every continuation starts from P's state, never another continuation's.

Two routes carry history across a boundary and both are cut and re-wired here:
- the recurrent state: P runs from the zero state; every continuation starts from P's final state
  (``initial_state``, broadcast), so the gradients of all continuations sum into P through it;
- the causal conv (width W): each continuation sees P's last W-1 *pre-conv* inputs (``in_proj_qkv`` outputs,
  LoRA included) as its history, and never another continuation's (conv-tail replay).

This replaces ``Qwen3_5GatedDeltaNet.forward`` only in a packed forward (a pack's
:class:`~packtrain.packed.pack_pass.PackPass` runs it); otherwise the module's own
forward runs unchanged. It calls the module's children through their own ``__call__`` (LoRA, FSDP hooks).
Shape legend: T buffer, P prefix length, S = T - P continuation tokens, N continuations, C conv channels,
W conv width, H/HV key/value heads, K/V head dims.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from packtrain.packed.kernels import torch_ref
from packtrain.packed.layout import PackLayout


def conv_rows(layout: PackLayout, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index the conv reads the buffer through: (rows [T + segments x (W-1)], keep [T]).

    ``rows`` lays every segment out after its own history (``layout.conv_histories``: W-1 zero rows before P, P's
    last W-1 rows before each continuation of a pack, a node's path before it in a prefix tree; buffer indices, -1
    for a zero row). A conv over that sequence computes every token from exactly its standalone inputs; ``keep``
    picks the outputs of real tokens (the W-1 outputs that straddle two segments are never read). No padding to
    the longest continuation.
    """
    key = ("conv_rows", width)
    if key not in layout._cache:
        rows, keep = [], []
        for history, start, end in layout.conv_histories(width):
            keep.extend(range(len(rows), len(rows) + end - start))  # output r reads rows r..r+h
            rows.extend(history + list(range(start, end)))
        device = layout.input_ids.device
        layout._cache[key] = (torch.tensor(rows, dtype=torch.long, device=device),
                              torch.tensor(keep, dtype=torch.long, device=device))
    return layout._cache[key]


def packed_conv_torch(mixed_TC, weight_CW, bias_C, layout: PackLayout) -> torch.Tensor:
    rows, keep = conv_rows(layout, weight_CW.shape[-1])
    padded = torch.cat([mixed_TC.new_zeros(1, mixed_TC.shape[1]), mixed_TC])
    return torch_ref.conv_rows_silu(padded.index_select(0, rows + 1), weight_CW, bias_C, keep)


# Continuations run in chunks of 16 rows, or 32 when one of them is longer than 256 tokens: each pads only its
# last chunk, and smaller chunks cost less intra-chunk work but more steps of the scan, which a long continuation
# pays for (docs/performance.md, "The continuations' chunk": `python tools/bench/chunk_rule.py --varlen`).
SHORT_CHUNK, LONG_CHUNK, LONG_CONTINUATION = 16, 32, 256
# P in chunks of 32, where transformers' and fla's rule take 64: faster on the CPU at the bench model's GDN shape
# (docs/performance.md, "P's chunk rule vs transformers' fallback": `python tools/bench/chunk_rule.py`).
PREFIX_CHUNK = 32


def continuation_chunk(cont_lens) -> int:
    return LONG_CHUNK if max(cont_lens) > LONG_CONTINUATION else SHORT_CHUNK


def continuation_delta_rule_torch(q_SHK, k_SHK, v_SHV, g_SH, beta_SH, layout: PackLayout, state,
                                  final_state: bool = False):
    """Every continuation from P's final state ``state`` [1, HV, K, V] in one varlen call (each padded only to its
    own multiple of the chunk, not to the longest). With ``final_state``: (output, each continuation's final state
    [N, HV, K, V])."""
    n = len(layout.cont_lens)
    out_S, final = torch_ref.chunk_gated_delta_rule(
        q_SHK[None], k_SHK[None], v_SHV[None], g_SH[None], beta_SH[None], initial_state=state.expand(n, -1, -1, -1),
        output_final_state=final_state, cu_seqlens=layout.cu_seqlens_host,
        chunk_size=continuation_chunk(layout.cont_lens))
    out_S = out_S.squeeze(0)  # a view: out_S[0]'s backward would copy the gradient
    return (out_S, final) if final_state else out_S


def packed_delta_rule_torch(q_THK, k_THK, v_THV, g_TH, beta_TH, layout: PackLayout) -> torch.Tensor:
    """P from the zero state, then every continuation from P's final state in one varlen call (each padded only
    to its own multiple of the chunk, not to the longest)."""
    p = layout.prefix_len
    out_P, state = torch_ref.chunk_gated_delta_rule(
        q_THK[None, :p], k_THK[None, :p], v_THV[None, :p], g_TH[None, :p], beta_TH[None, :p],
        output_final_state=True, chunk_size=PREFIX_CHUNK)
    out_S = continuation_delta_rule_torch(q_THK[p:], k_THK[p:], v_THV[p:], g_TH[p:], beta_TH[p:], layout, state)
    return torch.cat([out_P.squeeze(0), out_S])


def _tail_layout(layout: PackLayout, width: int) -> PackLayout:
    """frozen: the layout of the buffer [P's W-1 tail ; continuations], a pack whose prefix is just the tail (each
    continuation's conv reads exactly those rows of P), so both back ends' packed conv run it unchanged."""
    key = ("tail_layout", width)
    if key not in layout._cache:
        layout._cache[key] = dataclasses.replace(layout, prefix_len=width - 1, _cache={})
    return layout._cache[key]


def continuation_tails(conv_in_RC: torch.Tensor, layout: PackLayout, width: int) -> torch.Tensor:
    """[N, C, W-1]: each continuation's last W-1 pre-conv inputs (P's tail before it where it is shorter), from the
    conv's input [P's W-1 tail ; continuations] -- the history its next token's conv reads."""
    h = width - 1
    rows = [(list(range(h)) + list(range(h + a, h + b)))[-h:] if h else []
            for a, b in zip(layout.cu_seqlens_host, layout.cu_seqlens_host[1:])]
    index = torch.tensor(rows, dtype=torch.long, device=conv_in_RC.device).reshape(len(rows), h)
    return conv_in_RC[index].transpose(1, 2)


def gdn_projections(module, hidden_states: torch.Tensor):
    """The family's projection split (:mod:`packtrain.packed.families`) of a batch-1 buffer: (pre-conv q|k|v
    [T, C], z, b, a, the conv weight [C, W]), each projection through its own call (LoRA, FSDP hooks)."""
    assert hidden_states.shape[0] == 1, "a pack is batch 1"
    mixed_TC, z, b, a = module.packtrain_split(module, hidden_states.squeeze(0))  # a view, as its gradient
    return mixed_TC, z, b, a, module.conv1d.weight.squeeze(1)


def conv_torch(module, conv_in_TC: torch.Tensor, weight_CW: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    """The causal conv + SiLU of every segment of ``layout`` from its own history (``layout.conv_histories``)."""
    return packed_conv_torch(conv_in_TC, weight_CW, module.conv1d.bias, layout)


def conv_fla(module, conv_in_TC: torch.Tensor, weight_CW: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    """The same in fla's varlen conv."""
    from packtrain.packed.kernels import fla_backend

    return fla_backend.packed_conv(conv_in_TC, weight_CW, module.conv1d.bias, layout)


def gdn_heads(module, conv_TC: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
    """The conv's output split into heads, and the gates: (q [T, H, K], k, v [T, HV, V], g [T, HV], beta)."""
    T = conv_TC.shape[0]
    q, k, v = torch.split(conv_TC, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(T, -1, module.head_k_dim)
    k = k.reshape(T, -1, module.head_k_dim)
    v = v.reshape(T, -1, module.head_v_dim)
    beta = b.sigmoid()
    # If the model is loaded in fp16, without the .float() here, A might be -inf (as transformers does)
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    return q, k, v, g, beta


def gdn_output(module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The delta rule's output [T, HV, V] through the gated norm (with z) and out_proj: [1, T, D]."""
    T = core.shape[0]
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, T, -1))


def delta_rule_torch(module, conv_TC: torch.Tensor, b, a, layout: PackLayout, state, states: bool):
    """The delta rule over the conv's output, from P's ``state`` when it is given (the buffer holds only
    continuations)."""
    q, k, v, g, beta = gdn_heads(module, conv_TC, b, a)
    if state is not None:
        return continuation_delta_rule_torch(q, k, v, g, beta, layout, state, states)
    return packed_delta_rule_torch(q, k, v, g, beta, layout)


def delta_rule_fla(module, conv_TC: torch.Tensor, b, a, layout: PackLayout, state, states: bool):
    """The same in fla's kernels, whose calls take their rows before the heads are split (fla_backend)."""
    from packtrain.packed.kernels import fla_backend, fla_frozen

    heads = functools.partial(gdn_heads, module)
    if state is not None:
        return fla_frozen.continuation_delta_rule(heads, conv_TC, b, a, layout, state, states)
    return fla_backend.packed_delta_rule(heads, conv_TC, b, a, layout)


def packed_gdn_forward(module, hidden_states: torch.Tensor, layout: PackLayout, prefix=None, states: bool = False):
    """Same computation as ``Qwen3_5GatedDeltaNet.forward`` / ``Qwen3NextGatedDeltaNet.forward`` (no cache, no
    padding mask) on a pack: [1, T, D]. ``prefix`` (:class:`~packtrain.packed.prefix.PrefixState`): P's state from
    outside (frozen context, continuation groups, a generation's items): the buffer holds only the continuations,
    which start from P's conv tail and recurrent state. With ``states`` (a generation's item pass, with ``prefix``):
    (output, each continuation's conv state [N, C, W-1], its recurrent state [N, HV, K, V])."""
    mixed_TC, z, b, a, weight_CW = gdn_projections(module, hidden_states)
    W = weight_CW.shape[-1]
    state = None
    if prefix is not None:
        tail_W1C, state = prefix.conv_and_state(module.layer_idx, W)
        conv_in, conv_layout = torch.cat([tail_W1C.to(mixed_TC.dtype), mixed_TC]), _tail_layout(layout, W)
    else:
        conv_in, conv_layout = mixed_TC, layout
    del mixed_TC
    kernels = module.packtrain_kernels  # the back end's, picked once (packtrain.packed.patch.pick_kernels)
    warm_up = W - 1 if prefix is not None else 0  # P's tail before the continuations: dropped after the conv
    # the conv's output is not bound here: it is let go once the delta rule has read it, before the gated norm runs
    core = kernels.delta_rule(module, kernels.conv(module, conv_in, weight_CW, conv_layout)[warm_up:], b, a, layout,
                              state, states)
    if states:
        core, recurrent_states = core

    out = gdn_output(module, core, z)
    if states:
        return out, continuation_tails(conv_in, layout, W), recurrent_states
    return out
