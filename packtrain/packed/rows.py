"""Decoding rows: B continuations of one P, each one token further per call, reading P's state shared.

A generation (:mod:`packtrain.packed.decode`) prefills P once and the items of a pack as its continuations, then
decodes every continuation in one batch. :class:`Rows` is what that batch carries from one token to the next, per
decoder layer:
- an attention layer reads P's keys and values from the :class:`~packtrain.packed.prefix.PrefixState` (batch 1,
  shared by every row, never copied per row) and the row's own keys and values (its item and what it generated so
  far), in a buffer with room for every token the row may reach; the softmax runs over both parts at once;
- a Gated DeltaNet layer carries each row's conv tail (its last W-1 pre-conv inputs) and its recurrent state.

:func:`attend` and :func:`gdn_step` are the two layer kinds' computations for one new token per row; the patched
attention and GDN forwards (:mod:`packtrain.packed.patch`) reach them through :meth:`Rows.attention` and
:meth:`Rows.gated_deltanet` when decoding passes a :class:`Rows` under the layout kwarg, where a packed forward
passes a :class:`~packtrain.packed.pack_pass.PackPass`. Shape legend: B rows, H query heads, G key/value heads, r = H / G, P prefix length, L the own buffer's
length, D head dim, C conv channels, W conv width, HV value heads, K/V head dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from packtrain.packed.kernels import torch_ref


@dataclass
class Rows:
    """B decoding rows on one P. ``lengths`` counts each row's own tokens whose keys are in the buffers; ``text`` and
    ``mrope`` are the positions the next token takes (the text position and the M-RoPE one, equal for text)."""
    prefix: object  # packtrain.packed.prefix.PrefixState, batch 1
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # own keys, values [B, G, L, D]
    gdn: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # [B, C, W-1], [B, HV, K, V]
    lengths: torch.Tensor | None = None  # [B]
    text: torch.Tensor | None = None  # [B]
    mrope: torch.Tensor | None = None  # [B]

    @property
    def size(self) -> int:
        return int(self.lengths.numel())

    def position_ids(self, mrope: bool) -> torch.Tensor:
        """The next token's positions: M-RoPE ``[4, B, 1]`` (text position, then three equal axes) or ``[B, 1]``."""
        if not mrope:
            return self.text[:, None]
        return torch.stack([self.text, self.mrope, self.mrope, self.mrope])[:, :, None]

    def advance(self) -> None:
        """After a call: every row holds one more token."""
        self.lengths, self.text, self.mrope = self.lengths + 1, self.text + 1, self.mrope + 1

    # -- what the patched layers call on the object under the layout kwarg (as on a pack's PackPass) -----------
    def attention(self, module, query, key, value, scaling, dropout) -> torch.Tensor:
        """A full-attention layer, one new token per row: [B, H, 1, D] (no dropout: generation runs in eval)."""
        return attend(self, module.layer_idx, query, key, value, scaling)

    def gated_deltanet(self, module, hidden_states: torch.Tensor) -> torch.Tensor:
        return gdn_step(module, hidden_states, self)

    def grad_rows_from(self, layer_idx: int) -> int | None:
        return None  # every row (kv_only's row-sparse backward is a pack's)

    def select(self, keep: torch.Tensor) -> Rows:
        """The rows ``keep`` (indices) only, e.g. once the others have stopped."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, keep)

        return Rows(self.prefix, {i: (pick(k), pick(v)) for i, (k, v) in self.kv.items()},
                    {i: (pick(c), pick(s)) for i, (c, s) in self.gdn.items()},
                    pick(self.lengths), pick(self.text), pick(self.mrope))


def attend(rows: Rows, layer_idx: int, q_BH1D, k_BG1D, v_BG1D, scaling: float) -> torch.Tensor:
    """One new token per row through a full-attention layer: its key and value go into the row's buffer, then its
    query reads P's keys (shared) and the row's own, one softmax over both. Returns [B, H, 1, D]."""
    keys, values = rows.kv[layer_idx]
    B, G, L, D = keys.shape
    scaling = D ** -0.5 if scaling is None else scaling
    index = torch.arange(B, device=keys.device)
    keys[index, :, rows.lengths] = k_BG1D[:, :, 0].to(keys.dtype)
    values[index, :, rows.lengths] = v_BG1D[:, :, 0].to(values.dtype)
    k_P, v_P = rows.prefix.keys_values(layer_idx)  # [1, G, P, D]
    q = q_BH1D.reshape(B, G, -1, D)  # query head g * r + j reads key head g, as transformers' repeat_kv
    s_P = torch.einsum("bgrd,gpd->bgrp", q, k_P[0].to(q.dtype))
    s_own = torch.einsum("bgrd,bgld->bgrl", q, keys.to(q.dtype))
    seen = torch.arange(L, device=keys.device)[None] <= rows.lengths[:, None]  # [B, L]: the row's tokens so far
    s_own = s_own.masked_fill(~seen[:, None, None], float("-inf"))
    p = k_P.shape[2]
    weights = (torch.cat([s_P, s_own], dim=-1) * scaling).softmax(-1, dtype=torch.promote_types(q.dtype,
                                                                                                  torch.float32))
    out = (torch.einsum("bgrp,gpd->bgrd", weights[..., :p].to(q.dtype), v_P[0].to(q.dtype))
           + torch.einsum("bgrl,bgld->bgrd", weights[..., p:].to(q.dtype), values.to(q.dtype)))
    return out.reshape(B, -1, 1, D)


def gdn_step(module, hidden_B1D: torch.Tensor, rows: Rows) -> torch.Tensor:
    """One new token per row through a Gated DeltaNet layer (``Qwen3_5GatedDeltaNet``'s single-token path): the
    causal conv over the row's tail and the token, then one step of the gated delta rule from the row's state."""
    B = hidden_B1D.shape[0]
    mixed_BC, z, b, a = module.packtrain_split(module, hidden_B1D[:, 0])  # each row one token
    weight_CW = module.conv1d.weight.squeeze(1)
    tail, state = rows.gdn[module.layer_idx]
    window = torch.cat([tail.to(mixed_BC.dtype), mixed_BC[:, :, None]], dim=-1)  # [B, C, W]
    conv = (window.to(weight_CW.dtype) * weight_CW).sum(-1)
    if module.conv1d.bias is not None:
        conv = conv + module.conv1d.bias
    mixed_BC = F.silu(conv).to(mixed_BC.dtype)
    q, k, v = torch.split(mixed_BC, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(B, 1, -1, module.head_k_dim)
    k = k.reshape(B, 1, -1, module.head_k_dim)
    v = v.reshape(B, 1, -1, module.head_v_dim)
    beta = b.sigmoid()[:, None]
    g = (-module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias))[:, None]
    core, state = torch_ref.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    rows.gdn[module.layer_idx] = (window[..., 1:], state)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(B, 1, -1))
