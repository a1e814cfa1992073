"""Generation on one P: P prefilled once, every item a continuation of one pack, then all of them decoded together.

Three calls of :class:`packtrain.packed.lm.PackedLM` (the FSDP root), each a whole forward of the stack:
1. :class:`~packtrain.packed.prefix.PrefixCall`: P alone, its :class:`~packtrain.packed.prefix.PrefixState` (what
   every continuation reads of P), as training's frozen context and continuation groups compute it;
2. :class:`ItemsCall`: the pack's items as continuations against that state (the frozen context's packed path,
   :func:`packtrain.packed.context.continuations_on`, vision batch included). The layers leave each continuation's
   own state in the pass's :class:`~packtrain.packed.pack_pass.ItemRecord` (attention keys and values, GDN conv
   state and recurrent state), and the head reads each item's last row: the logits of every row's first generated
   token, and the :class:`Rows` to go on from;
3. :class:`DecodeCall`: one token per row, every row against P's shared keys and its own (:mod:`packtrain.packed.rows`:
   the :class:`Rows` go under the layout kwarg where a pack's :class:`~packtrain.packed.pack_pass.PackPass` goes).

An item with no tokens (a continuation that is its target alone) starts from P's state itself: its first logits are
P's last row's. Exactness: row for row this is the model's own computation of ``concat(P, item, generated)``
(tests/run/test_generate.py compares the tokens with transformers' ``generate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from packtrain.packed.context import continuations_on
from packtrain.packed.families import family_of
from packtrain.packed.layout import PackLayout
from packtrain.packed.pack_pass import ItemRecord
from packtrain.packed.patch import LAYOUT_KWARG
from packtrain.packed.prefix import PrefixState
from packtrain.packed.rows import Rows


def _head(lm, hidden_ND: torch.Tensor) -> torch.Tensor:
    return lm.parts.lm_head(hidden_ND)


def _own_buffers(record: ItemRecord, layout: PackLayout | None, prefix: PrefixState, prefix_len: int, empty: int,
                 room: int) -> Rows:
    """The rows' state after their items: the keys, conv states and recurrent states the item pass recorded per
    continuation, then ``empty`` rows that start from P's own state."""
    n = len(layout.cont_lens) if layout is not None else 0
    lengths = list(layout.cont_lens) if layout is not None else []
    B = n + empty
    kv = {}
    for layer_idx, (k_P, v_P) in prefix.kv.items():
        G, D = k_P.shape[1], k_P.shape[3]
        keys, values = k_P.new_zeros(B, G, room, D), v_P.new_zeros(B, G, room, D)
        if n:
            k_S, v_S = record.keys_values[layer_idx]  # [1, G, S, D], every continuation's own
            for i, (a, b) in enumerate(zip(layout.cu_seqlens_host, layout.cu_seqlens_host[1:])):
                keys[i, :, :b - a] = k_S[0, :, a:b]
                values[i, :, :b - a] = v_S[0, :, a:b]
        kv[layer_idx] = (keys, values)
    gdn = {}
    for layer_idx, (tail, state) in prefix.gdn.items():
        tails, states = [tail.expand(empty, -1, -1)], [state.expand(empty, -1, -1, -1)]
        if n:
            tails.insert(0, record.conv_states[layer_idx].to(tail.dtype))
            states.insert(0, record.recurrent_states[layer_idx].to(state.dtype))
        gdn[layer_idx] = (torch.cat(tails), torch.cat(states))
    device = prefix.last.device
    mrope, text = [], []
    if n:
        pos = layout.position_ids[1:].to(device)  # [3, 1, T] M-RoPE coordinates of concat(P, item)
        for a, b in zip(layout.cu_seqlens_host, layout.cu_seqlens_host[1:]):
            mrope.append(int(pos[:, 0, layout.prefix_len + a:layout.prefix_len + b].max()) + 1)
            text.append(layout.prefix_len + b - a)
    mrope += [prefix_len] * empty  # P is text: its next position is its length on every axis
    text += [prefix_len] * empty

    def longs(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return Rows(prefix, kv, gdn, longs(lengths + [0] * empty), longs(text), longs(mrope))


@dataclass
class ItemsCall:
    """A pack's items against P's state. ``layout``: P and the non-empty items (``build_pack_layout(...,
    targets=False)``); ``empty``: how many rows without an item follow them; ``room``: own tokens each row may
    reach (its item and what it may generate)."""
    layout: PackLayout | None
    prefix: PrefixState
    prefix_len: int
    empty: int
    room: int

    def run(self, lm) -> tuple[torch.Tensor, Rows]:
        """The items against P's state: (each row's first logits [B, V], the rows to decode from)."""
        record = ItemRecord()
        parts = []
        layout = self.layout
        if layout is not None:  # [1, 1 + S, D]: P's last row first
            hidden, _, _ = continuations_on(lm, layout, self.prefix, constant=False, record=record)
            ends = torch.tensor(layout.cu_seqlens_host[1:], dtype=torch.long, device=hidden.device)
            parts.append(hidden[0].index_select(0, ends))
        if self.empty:
            parts.append(self.prefix.last[0].expand(self.empty, -1))
        logits = _head(lm, torch.cat(parts))
        return logits, _own_buffers(record, layout, self.prefix, self.prefix_len, self.empty, self.room)


@dataclass
class DecodeCall:
    rows: Rows
    tokens: torch.Tensor  # [B] each row's newest token

    def run(self, lm) -> torch.Tensor:
        """One token per row through the model's body, every layer against the rows' state: [B, V] logits."""
        rows = self.rows
        body = lm.parts.body
        out = body(input_ids=self.tokens[:, None],
                   position_ids=rows.position_ids(family_of(lm.model).positions == "mrope"),
                   attention_mask={"full_attention": None, "linear_attention": None}, use_cache=False,
                   **{LAYOUT_KWARG: rows})
        rows.advance()
        return _head(lm, out.last_hidden_state[:, -1])
