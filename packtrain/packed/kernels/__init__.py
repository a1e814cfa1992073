"""Kernel back ends for the packed forward, chosen once and reported; nothing falls back silently.

- ``torch``: pure torch (CPU reference; also runs on CUDA). Gated DeltaNet runs P once, then all continuations in
  one varlen call from P's final state (each padded only to its own multiple of the chunk); attention runs P
  causally once and the continuations in length buckets, each a padded batch against [P's keys ; their own]
  (``batched``), or over the whole buffer with a dense mask (``dense``, a second reference built straight from
  the predicate).
- ``fla``: fla's ``chunk_gated_delta_rule`` with ``cu_seqlens`` and a per-continuation ``initial_state``, fla's
  varlen causal conv, and FlexAttention with one BlockMask per pack (CUDA). On CPU only under Triton's interpreter
  (``TRITON_INTERPRET=1``, :mod:`packtrain.packed.kernels.interpreter`), with the batched torch attention: FlexAttention
  has no CPU backward. That is how CI runs fla's kernels; it is slow and meant for tests.

On CPU a pack's dense MLPs run in blocks of ``mlp_rows`` buffer rows (:func:`packtrain.packed.patch.patch_model`):
row by row the MLP is the same computation, and a block's [rows, intermediate] activations stay in the cache, where
a whole pack's outgrow it (docs/performance.md, "MLP blocks").
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Backend:
    gdn: str  # "torch" | "fla"
    attention: str  # "batched" | "dense" | "flex"
    mlp_rows: int | None = None  # a packed forward's dense MLPs in blocks of this many rows (None: whole buffer)

    def describe(self) -> str:
        blocks = f", mlp blocks of {self.mlp_rows} rows" if self.mlp_rows else ""
        return f"gated-deltanet={self.gdn}, attention={self.attention}{blocks}"


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


# CPU: a pack's MLP rows per block, so that one [rows, intermediate] activation stays in a core's cache (the bench
# model's [512, 768] float32 is 1.5 MiB, under a 2 MiB L2); other block sizes: docs/performance.md, "MLP blocks".
CPU_MLP_ROWS = 512


def select_backend(kernels: str, device: torch.device | str, attention: str | None = None) -> Backend:
    """``kernels``: auto | torch | fla. ``auto`` takes fla on CUDA when it imports, else torch."""
    device = torch.device(device)
    mlp_rows = CPU_MLP_ROWS if device.type == "cpu" else None
    if kernels == "auto":
        kernels = "fla" if device.type == "cuda" and fla_available() else "torch"
    if kernels == "fla":
        if not fla_available():
            raise ValueError("model.kernels=fla but the `fla` package is not installed (pip install 'packtrain[fla]')")
        if device.type == "cuda":
            return Backend(gdn="fla", attention=attention or "flex")
        from packtrain.packed.kernels import interpreter

        if not interpreter.interpreter_on():
            raise ValueError(f"model.kernels=fla on {device.type}: fla's Triton kernels run off CUDA only under "
                             "Triton's interpreter (slow, for tests): start with TRITON_INTERPRET=1 in the "
                             "environment, or use model.kernels=torch")
        interpreter.apply()
        return Backend(gdn="fla", attention=attention or "batched", mlp_rows=mlp_rows)
    if kernels == "torch":
        return Backend(gdn="torch", attention=attention or "batched", mlp_rows=mlp_rows)
    raise ValueError(f"model.kernels: unknown back end {kernels!r} (auto | torch | fla)")
