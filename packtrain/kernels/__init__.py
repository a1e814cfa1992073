"""Kernel back ends for the packed forward, chosen once and reported; nothing falls back silently.

- ``torch``: pure torch (CPU reference; also runs on CUDA). Gated DeltaNet runs P once, then all continuations in
  one varlen call from P's final state (each padded only to its own multiple of the chunk); attention runs P
  causally once and the continuations in length buckets, each a padded batch against [P's keys ; their own]
  (``batched``), or over the whole buffer with a dense mask (``dense``, a second reference built straight from
  the predicate).
- ``fla``: fla's ``chunk_gated_delta_rule`` with ``cu_seqlens`` and a per-continuation ``initial_state``, fla's
  varlen causal conv, and FlexAttention with one BlockMask per pack (CUDA). On CPU only under Triton's interpreter
  (``TRITON_INTERPRET=1``, :mod:`packtrain.kernels.interpreter`), with the batched torch attention: FlexAttention
  has no CPU backward. That is how CI runs fla's kernels; it is slow and meant for tests.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Backend:
    gdn: str  # "torch" | "fla"
    attention: str  # "batched" | "dense" | "flex"

    def describe(self) -> str:
        return f"gated-deltanet={self.gdn}, attention={self.attention}"


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def select_backend(kernels: str, device: torch.device | str, attention: str | None = None) -> Backend:
    """``kernels``: auto | torch | fla. ``auto`` takes fla on CUDA when it imports, else torch."""
    device = torch.device(device)
    if kernels == "auto":
        kernels = "fla" if device.type == "cuda" and fla_available() else "torch"
    if kernels == "fla":
        if not fla_available():
            raise ValueError("model.kernels=fla but the `fla` package is not installed (pip install 'packtrain[fla]')")
        if device.type == "cuda":
            return Backend(gdn="fla", attention=attention or "flex")
        from packtrain.kernels import interpreter

        if not interpreter.interpreter_on():
            raise ValueError(f"model.kernels=fla on {device.type}: fla's Triton kernels run off CUDA only under "
                             "Triton's interpreter (slow, for tests): start with TRITON_INTERPRET=1 in the "
                             "environment, or use model.kernels=torch")
        interpreter.apply()
        return Backend(gdn="fla", attention=attention or "batched")
    if kernels == "torch":
        return Backend(gdn="torch", attention=attention or "batched")
    raise ValueError(f"model.kernels: unknown back end {kernels!r} (auto | torch | fla)")
