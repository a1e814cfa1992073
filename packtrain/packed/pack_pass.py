"""What the patched layers of one packed forward read: a :class:`PackPass`, passed under the layout kwarg.

A packed forward hands the model's body one object under ``LAYOUT_KWARG`` (:mod:`packtrain.packed.patch`), and
every patched layer asks it what to do: a full-attention layer calls its ``attention``, a Gated DeltaNet layer its
``gated_deltanet``, kv_only's row-sparse hook on a decoder layer (:mod:`packtrain.packed.context`) its
``grad_rows_from``. Three kinds of object answer those three: a :class:`PackPass` (a pack's buffer and how its kernels
run on it), a prefix tree's :class:`packtrain.packed.tree.TreePass`, and the decoding rows of a generation
(:class:`packtrain.packed.rows.Rows`, one token per row). The layers dispatch by these methods, never by type.

A PackPass is the buffer (:class:`~packtrain.packed.layout.PackLayout`, which describes only the buffer) and what
the kernels read besides it:
- ``prefix``: P read from outside (a :class:`~packtrain.packed.prefix.PrefixState`): the buffer then holds only the
  continuations, which read P's keys and values, conv state and recurrent state from it (the frozen context, the
  continuation groups, a generation's item pass);
- ``keep_from``: kv_only on a whole pack: per decoder layer, the first buffer row whose output may get gradient
  (:func:`packtrain.packed.context.keep_from`);
- ``record``: a generation's item pass (with ``prefix``): each layer leaves every continuation's own state in an
  :class:`ItemRecord`, the rows decoding goes on from (:mod:`packtrain.packed.decode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from packtrain.packed.attention import pack_attention
from packtrain.packed.gdn import packed_gdn_forward
from packtrain.packed.layout import PackLayout
from packtrain.packed.prefix import Pairs, PrefixState


@dataclass
class ItemRecord:
    """Every continuation's own state after a pass against P's state, per layer (transformers' cache names)."""
    keys_values: Pairs = field(default_factory=dict)  # attention layer -> (keys, values) [1, G, S, D]
    conv_states: dict[int, torch.Tensor] = field(default_factory=dict)  # GDN layer -> [N, C, W-1]
    recurrent_states: dict[int, torch.Tensor] = field(default_factory=dict)  # GDN layer -> [N, HV, K, V]


@dataclass
class PackPass:
    """One packed forward of ``layout``'s buffer (see the module docstring for the optional parts)."""
    layout: PackLayout
    prefix: PrefixState | None = None
    keep_from: tuple[int, ...] | None = None
    record: ItemRecord | None = None

    def __post_init__(self):
        if self.record is not None and self.prefix is None:
            raise ValueError("an item record needs P's state from outside (prefix)")
        if self.keep_from is not None and self.prefix is not None:
            raise ValueError("keep_from is kv_only's on a whole pack; with P's state from outside there is no P row")

    def attention(self, module, query, key, value, scaling, dropout) -> torch.Tensor:
        """A full-attention layer on the buffer: [1, H, T, D]."""
        if self.record is not None:  # the continuations' own keys and values
            self.record.keys_values[module.layer_idx] = (key, value)
        return pack_attention(module, query, key, value, self.layout, scaling, dropout, self.prefix,
                              self.keep_from)

    def gated_deltanet(self, module, hidden_states: torch.Tensor) -> torch.Tensor:
        """A Gated DeltaNet layer on the buffer: [1, T, D]."""
        if self.record is None:
            return packed_gdn_forward(module, hidden_states, self.layout, self.prefix)
        out, conv, state = packed_gdn_forward(module, hidden_states, self.layout, self.prefix, states=True)
        self.record.conv_states[module.layer_idx] = conv
        self.record.recurrent_states[module.layer_idx] = state
        return out

    def grad_rows_from(self, layer_idx: int) -> int | None:
        """The first buffer row of the decoder layer ``layer_idx`` whose output may get gradient (None: every row)."""
        return None if self.keep_from is None else self.keep_from[layer_idx]
