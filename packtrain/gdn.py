"""Gated DeltaNet on a packed buffer: every continuation starts from P's state, never another continuation's.

Two routes carry history across a boundary and both are cut and re-wired here:
- the recurrent state: P runs from the zero state; every continuation starts from P's final state
  (``initial_state``, broadcast), so the gradients of all continuations sum into P through it;
- the causal conv (width W): each continuation sees P's last W-1 *pre-conv* inputs (``in_proj_qkv`` outputs,
  LoRA included) as its history, and never another continuation's (conv-tail replay).

This replaces ``Qwen3_5GatedDeltaNet.forward`` only when a pack layout is passed; otherwise the module's own
forward runs unchanged. It calls the module's children through their own ``__call__`` (LoRA, FSDP hooks).
Shape legend: T buffer, P prefix length, S = T - P continuation tokens, N continuations, L longest, C conv
channels, W conv width, H/HV key/value heads, K/V head dims.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from packtrain.kernels import Backend
from packtrain.kernels import torch_ref
from packtrain.layout import PackLayout


def _pad(x_S: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    """[S, ...] continuation tokens -> [N, L, ...] right-padded with zeros (both ops below are causal, so
    padding at the end of a continuation changes nothing before it)."""
    zero = x_S.new_zeros((1,) + x_S.shape[1:])
    return torch.cat([x_S, zero])[layout.pad_index]


def _unpad(x_NL: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    return x_NL.flatten(0, 1)[layout.unpad_index]


def conv_tail(mixed_TC: torch.Tensor, layout: PackLayout, width: int) -> torch.Tensor:
    """P's last W-1 conv inputs [W-1, C] (zero rows where P is shorter, as the zero history P starts from).
    A gather, so the gradients of every continuation's history sum back into P's rows."""
    padded = torch.cat([mixed_TC.new_zeros(1, mixed_TC.shape[1]), mixed_TC])
    return padded[layout.conv_tail_index(width) + 1]


def packed_conv_torch(mixed_TC, weight_CW, bias_C, layout: PackLayout) -> torch.Tensor:
    p, W = layout.prefix_len, weight_CW.shape[-1]
    out_P = torch_ref.causal_conv_silu(mixed_TC[:p].T[None], weight_CW, bias_C)[0].T
    cont_NLC = _pad(mixed_TC[p:], layout)
    history = conv_tail(mixed_TC, layout, W).T[None].expand(cont_NLC.shape[0], -1, -1)
    out_NCL = torch_ref.conv_with_history_silu(cont_NLC.transpose(1, 2), history, weight_CW, bias_C)
    return torch.cat([out_P, _unpad(out_NCL.transpose(1, 2), layout)])


def continuation_delta_rule_torch(q_SHK, k_SHK, v_SHV, g_SH, beta_SH, layout: PackLayout, state) -> torch.Tensor:
    """Every continuation as one right-padded batch from P's final state ``state`` [1, HV, K, V]."""
    padded = [_pad(x, layout) for x in (q_SHK, k_SHK, v_SHV, g_SH, beta_SH)]
    n = padded[0].shape[0]
    out_N, _ = torch_ref.chunk_gated_delta_rule(*padded, initial_state=state.expand(n, -1, -1, -1))
    return _unpad(out_N, layout)


def packed_delta_rule_torch(q_THK, k_THK, v_THV, g_TH, beta_TH, layout: PackLayout) -> torch.Tensor:
    p = layout.prefix_len
    out_P, state = torch_ref.chunk_gated_delta_rule(
        q_THK[None, :p], k_THK[None, :p], v_THV[None, :p], g_TH[None, :p], beta_TH[None, :p],
        output_final_state=True)
    out_S = continuation_delta_rule_torch(q_THK[p:], k_THK[p:], v_THV[p:], g_TH[p:], beta_TH[p:], layout, state)
    return torch.cat([out_P[0], out_S])


def _tail_layout(layout: PackLayout, width: int) -> PackLayout:
    """frozen: the layout of the buffer [P's W-1 tail ; continuations], a pack whose prefix is just the tail (each
    continuation's conv reads exactly those rows of P), so both back ends' packed conv run it unchanged."""
    key = ("tail_layout", width)
    if key not in layout._cache:
        layout._cache[key] = dataclasses.replace(layout, prefix_len=width - 1, _cache={})
    return layout._cache[key]


def packed_gdn_forward(module, hidden_states: torch.Tensor, layout: PackLayout, backend: Backend) -> torch.Tensor:
    """Same computation as ``Qwen3_5GatedDeltaNet.forward`` / ``Qwen3NextGatedDeltaNet.forward`` (no cache, no
    padding mask) on a pack."""
    assert hidden_states.shape[0] == 1, "a pack is batch 1"
    x_TD = hidden_states[0]
    T = x_TD.shape[0]
    # the family's projection split (packtrain.families): pre-conv q|k|v, z, b, a
    mixed_TC, z, b, a = module.packtrain_split(module, x_TD)
    weight_CW = module.conv1d.weight.squeeze(1)
    W = weight_CW.shape[-1]
    frozen = layout.prefix_cache  # frozen context: the buffer holds only the continuations; P's tail and state
    if frozen is not None:  # are constants from P's no_grad pass
        tail_W1C, state = frozen.gdn(module.layer_idx, W)
        conv_in, conv_layout = torch.cat([tail_W1C.to(mixed_TC.dtype), mixed_TC]), _tail_layout(layout, W)
    else:
        conv_in, conv_layout = mixed_TC, layout

    if backend.gdn == "fla":
        from packtrain.kernels import fla_backend

        mixed_TC = fla_backend.packed_conv(conv_in, weight_CW, module.conv1d.bias, conv_layout)
    else:
        mixed_TC = packed_conv_torch(conv_in, weight_CW, module.conv1d.bias, conv_layout)
    if frozen is not None:
        mixed_TC = mixed_TC[W - 1:]

    q, k, v = torch.split(mixed_TC, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(T, -1, module.head_k_dim)
    k = k.reshape(T, -1, module.head_k_dim)
    v = v.reshape(T, -1, module.head_v_dim)
    beta = b.sigmoid()
    # If the model is loaded in fp16, without the .float() here, A might be -inf (as transformers does)
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)

    if frozen is not None and backend.gdn == "fla":
        from packtrain.kernels import fla_frozen

        core = fla_frozen.continuation_delta_rule(q, k, v, g, beta, layout, state)
    elif frozen is not None:
        core = continuation_delta_rule_torch(q, k, v, g, beta, layout, state)
    elif backend.gdn == "fla":
        from packtrain.kernels import fla_backend

        core = fla_backend.packed_delta_rule(q, k, v, g, beta, layout)
    else:
        core = packed_delta_rule_torch(q, k, v, g, beta, layout)

    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, T, -1))
