"""P's state: what a continuation reads of the positions before it, produced by one function and read by everyone.

A continuation of P reads three things of P, per decoder layer: an attention layer's keys and values (after k_norm
and RoPE, as attention reads them), a Gated DeltaNet layer's final recurrent state and its conv tail (the last W-1
pre-conv inputs, zero where P is shorter), and, for a target read off P's last row (a continuation without an
item), P's final hidden state there. :class:`PrefixState` holds exactly that. The same holds for any first
positions of a sequence: a walked example's windows read the state of everything before them.

- :func:`run_span` is the one place a span of a sequence runs through the model's own forward against the state
  before it (a :class:`StateCache`, transformers' cache interface) and records the state it leaves. P is the span
  ``[0, |P|)``; :class:`PrefixCall` runs it with gradient, without (``context_grad: frozen``), or cut as kv_only
  cuts.
- The readers: the frozen context, the continuation groups and a generation's items hand a PrefixState to the
  packed kernels (``PackPass.prefix``, :mod:`packtrain.packed.pack_pass`: attention reads
  :meth:`PrefixState.keys_values`, Gated DeltaNet :meth:`PrefixState.conv_and_state`); the walk's windows read it
  through :class:`StateCache`.
- :func:`backward_through` is the chain rule that returns the gradient into P (or a window) from its consumers,
  taken in two parts: the consumers' backward leaves the gradient on leaf copies (:meth:`PrefixState.leaves`), then
  one backward through P's graph with those gradients.

Shapes: keys/values [1, G, n, D] (n positions), conv tail [1, C, W-1], state [1, HV, K, V], last [1, 1, D].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from packtrain.packed.layout import PackLayout

Pairs = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer index -> two tensors


@dataclass
class PrefixState:
    """Per layer what the positions before a point leave for the positions after it."""
    kv: Pairs = field(default_factory=dict)  # attention layer -> (keys, values) [1, G, n, D]
    gdn: Pairs = field(default_factory=dict)  # GDN layer -> (conv tail [1, C, W-1], state [1, HV, K, V])
    last: torch.Tensor | None = None  # [1, 1, D] the final hidden state at the last position

    # -- what the packed kernels read --------------------------------------------------------------------------
    def keys_values(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer_idx]

    def conv_and_state(self, layer_idx: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last W-1 pre-conv inputs [W-1, C], the final state [1, HV, K, V])."""
        tail, state = self.gdn[layer_idx]
        return tail[0, :, tail.shape[-1] - (width - 1):].T, state

    # -- the chain rule in two parts ---------------------------------------------------------------------------
    def named(self) -> dict[tuple, torch.Tensor]:
        """Every tensor by a key (kind, layer, which) that two states of the same layers share."""
        out = {("kv", i, j): t for i, pair in self.kv.items() for j, t in enumerate(pair)}
        out.update({("gdn", i, j): t for i, pair in self.gdn.items() for j, t in enumerate(pair)})
        if self.last is not None:
            out[("last",)] = self.last
        return out

    def leaves(self, grad: bool) -> PrefixState:
        """Detached copies (sharing storage) that collect their consumers' gradients in ``.grad`` when ``grad``."""
        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().requires_grad_(grad)

        return PrefixState({i: (leaf(k), leaf(v)) for i, (k, v) in self.kv.items()},
                           {i: (leaf(c), leaf(s)) for i, (c, s) in self.gdn.items()},
                           None if self.last is None else leaf(self.last))

    def grads(self) -> dict[tuple, torch.Tensor | None]:
        """The gradients the leaves collected (None where nothing read a tensor)."""
        return {key: t.grad for key, t in self.named().items()}


def backward_through(lm, outputs: PrefixState, grads: dict[tuple, torch.Tensor | None], losses=()) -> None:
    """One backward of ``losses`` (scalars) together with ``grads`` (by :meth:`PrefixState.named` key) on the
    tensors of ``outputs``: the gradient its consumers left returns into the graph that produced it. Tensors
    without a gradient, or outside any graph, are left out.

    ``lm`` is the root that ran the forward. Under FSDP2 its own parameters (the final norm; tied embeddings) are
    gathered again first: this graph's forward ran before its consumers' backwards, after which FSDP may have
    resharded the root (torch 2.11's does), and no hook of the root regathers them: the root's outputs here are a
    :class:`PrefixState` or a window's, which FSDP does not look into. A recomputed norm would otherwise read
    the root's shards ("got mixed torch.Tensor and DTensor")."""
    tensors = [t for t in losses if t.requires_grad]
    gradients: list[torch.Tensor | None] = [None] * len(tensors)
    for key, t in outputs.named().items():
        g = grads.get(key)
        if g is not None and t.requires_grad:
            tensors.append(t)
            gradients.append(g)
    if tensors:
        unshard = getattr(lm, "unshard", None)  # FSDPModule.unshard; a no-op where the root is gathered already
        if unshard is not None:
            unshard()
        torch.autograd.backward(tensors, gradients)


class StateCache(DynamicCache):
    """transformers' cache interface over the :class:`PrefixState` before a span; records the span's own state.

    Stateless (inputs in, outputs recorded), so a checkpointed layer's recompute sees the same inputs again."""

    def __init__(self, config, before: PrefixState):
        super().__init__(config=config)
        self.before = before
        self.kv_out: Pairs = {}
        self.tail_out: dict[int, torch.Tensor] = {}
        self.state_out: dict[int, torch.Tensor] = {}

    def recorded(self, last: torch.Tensor | None = None) -> PrefixState:
        """The span's own state: its keys and values, and each GDN layer's conv tail and state at its end."""
        return PrefixState(dict(self.kv_out), {i: (self.tail_out[i], self.state_out[i]) for i in self.state_out},
                           last)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.kv_out[layer_idx] = (key_states, value_states)
        if layer_idx not in self.before.kv:
            return key_states, value_states
        k, v = self.before.kv[layer_idx]
        return torch.cat([k.to(key_states.dtype), key_states], -2), torch.cat([v.to(value_states.dtype),
                                                                              value_states], -2)

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.before.gdn[layer_idx][0] if layer_idx in self.before.gdn else None

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.before.gdn[layer_idx][1] if layer_idx in self.before.gdn else None

    def is_recording_past(self, layer_idx):
        return True  # never the in-place single-token conv update: a one-token span stays differentiable

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        tail = self.get_conv_state(layer_idx)
        full = conv_states if tail is None else torch.cat([tail.to(conv_states.dtype), conv_states], -1)
        keep = conv_kernel_size - 1  # zero history where the sequence so far is shorter, as the conv pads
        padded = F.pad(full, (max(0, keep - full.shape[-1]), 0))
        self.tail_out[layer_idx] = padded[..., padded.shape[-1] - keep:]
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self.state_out[layer_idx] = recurrent_states
        return recurrent_states


def run_span(lm, layout: PackLayout, start: int, end: int, before: PrefixState) -> tuple[torch.Tensor, PrefixState]:
    """Positions ``[start, end)`` of ``layout``'s sequence (P followed by one continuation, as a standalone layout
    holds it; or P of a pack) through the model's own forward, from the state ``before`` (the state of
    ``[0, start)``). Returns (the span's final hidden states [1, end - start, D], the span's own state)."""
    text_model = lm.parts.text_model
    cache = StateCache(text_model.config, before)
    if start == 0:
        mask = None  # causal from position 0: SDPA's own causal path
    else:  # every query sees every earlier position and its own span causally; explicit, so no builder guesses
        own = torch.ones(end - start, end - start, dtype=torch.bool, device=layout.input_ids.device).tril()
        mask = torch.cat([own.new_ones(end - start, start), own], dim=1)[None, None]
    body = dataclasses.replace(layout, input_ids=layout.input_ids[:, start:end], image_grid_thw=None,
                               pixel_values=None, _cache={})
    positions = lm.parts.positions(layout)[..., start:end]  # M-RoPE [4, 1, T] or 1-D [1, T] by family
    hidden = lm.run_body(body, cache=cache, use_cache=True, position_ids=positions,
                         attention_mask={"full_attention": mask, "linear_attention": None}).last_hidden_state
    return hidden, cache.recorded(hidden[:, -1:])


@dataclass
class PrefixCall:
    """One call of :class:`packtrain.packed.lm.PackedLM` (the FSDP root): P of ``layout`` alone."""
    layout: PackLayout

    def run(self, lm) -> PrefixState:
        """P under ``lm``'s ``packing.context_grad``: with its graph (full), under no_grad (frozen), or with the
        gradient cut at P's rows of every decoder-layer input (kv_only,
        :func:`packtrain.packed.cut.cut_at_layer_inputs`)."""
        p = self.layout.prefix_len
        with lm.context.prefix_pass(lm.parts.text_model.layers, p):
            _, state = run_span(lm, self.layout, 0, p, PrefixState())
        return state
