"""Three deliberately broken plumbings of the packed Gated DeltaNet, as test-only monkeypatches, for checking that
a parity check catches them (on both back ends: the conv tail comes from the layout both use; the initial state is
zeroed at the chunk-rule call of each)."""

from __future__ import annotations

import torch

from packtrain.kernels import torch_ref
from packtrain.layout import PackLayout

MUTATIONS = ["zero initial state", "no conv tail", "tail off by one"]


def _zero_initial_state(rule):
    def broken(*args, initial_state=None, **kwargs):
        if initial_state is not None:  # continuations start from zero instead of P's final state
            initial_state = torch.zeros_like(initial_state)
        return rule(*args, initial_state=initial_state, **kwargs)

    return broken


def break_plumbing(name: str, monkeypatch) -> None:
    """Apply mutation ``name`` for the rest of the test (``monkeypatch`` undoes it)."""
    if name == "zero initial state":
        monkeypatch.setattr(torch_ref, "chunk_gated_delta_rule", _zero_initial_state(torch_ref.chunk_gated_delta_rule))
        try:
            from packtrain.kernels import fla_backend
        except ImportError:  # no fla here: only the torch back end can run
            return
        monkeypatch.setattr(fla_backend, "chunk_gated_delta_rule", _zero_initial_state(fla_backend.chunk_gated_delta_rule))
    elif name == "no conv tail":  # every continuation's conv history is zeros instead of P's last W-1 inputs
        monkeypatch.setattr(PackLayout, "conv_tail_index",
                            lambda self, width: torch.full((width - 1,), -1, dtype=torch.long,
                                                           device=self.input_ids.device))
    elif name == "tail off by one":  # P's tokens W..2 before its end instead of W-1..1
        correct = PackLayout.conv_tail_index
        monkeypatch.setattr(PackLayout, "conv_tail_index", lambda self, width: (correct(self, width) - 1).clamp_min(-1))
    else:
        raise KeyError(name)
