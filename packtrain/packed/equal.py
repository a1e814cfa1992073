"""The equal-call rule: every rank issues the same sequence of collective calls, or FSDP's collectives deadlock.

A rank pads its calls in one of these ways, and only through this module and the unit kinds' ``pad``:

- slot k of a step's units runs on every rank; a rank with no unit for a slot runs a dummy (a real input on one
  example, its loss :func:`silenced`); each kind of unit pads its own slots (:meth:`packtrain.run.units.Kind.pad`
  through :func:`packtrain.run.units.pad_slots`: a walk also takes the slot's largest walk calls);
- inside a unit, calls a rank has no work for are :func:`filler_calls` (a walk's missing chunks) or zero-weight
  groups (:meth:`packtrain.run.units.GroupsKind.build`, run by :mod:`packtrain.packed.groups`);
- :func:`anchored`: a loss with nothing to learn still runs a backward (zero gradients), so the backward's
  reduce-scatters run too;
- every decision the ranks make together (the step's skip codes, the non-finite and stop flags at a step's boundary, a
  generation's "still decoding") is one all-reduce MAX of small integers, :func:`packtrain.distributed.agree`.
"""

from __future__ import annotations

from typing import Callable

import torch



def silenced(scale: float) -> float:
    """A dummy's loss scale: zero, and NaN stays NaN (an injected NaN shows on every rank)."""
    return scale * 0.0


def filler_calls(made: int, due: int, call: Callable[[], object]) -> None:
    """``call`` until ``made`` calls reach the ``due`` every rank makes."""
    for _ in range(due - made):
        call()


def anchored(loss: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``loss`` with a zero-gradient path to ``anchor``'s graph when it has none of its own (a frozen pack whose
    every target is read off P's last row): its backward then runs, as every other rank's does."""
    if torch.is_grad_enabled() and not loss.requires_grad:
        return loss + 0.0 * anchor.sum()
    return loss
