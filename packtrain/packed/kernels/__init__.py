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

Every back end runs the dense MLPs in recomputed tiles of ``mlp_rows`` buffer rows (``train.mlp_chunk_rows``) and
the RMSNorms in tiles of ``norm_rows`` (``train.norm_chunk_rows``; :mod:`packtrain.packed.recompute`) when they are
set: a tile's [rows, intermediate] activations, or a norm's float32 pieces, exist only while it runs. The device's
default tile: on CPU one that stays in a core's cache, where a whole pack's activations outgrow it
(docs/performance.md, "MLP blocks"); on CUDA tiles of thousands of rows, whose matmuls are large. Whether a run tiles
at all is the memory choice's (:mod:`packtrain.memory.savings`).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from packtrain.config.tiles import TILE_ROWS


@dataclass(frozen=True)
class Backend:
    """The kernels a run takes, by name, chosen once (:func:`select_backend`) and reported; the patched layers run
    the functions these names pick (:func:`packtrain.packed.patch.pick_kernels`), never the names themselves."""
    gdn: str  # "torch" | "fla"
    attention: str  # "batched" | "dense" | "flex"
    mlp_rows: int | None = None  # the dense MLPs in recomputed tiles of this many rows (None: whole)
    norm_rows: int | None = None  # the RMSNorms in recomputed tiles of this many rows (None: whole)
    gdn_kernel: str = "triton"  # with gdn "fla": "triton" (fla's own) | "flash_qla" (model.gdn_kernel)

    @property
    def fla(self) -> bool:
        """Gated DeltaNet runs on fla's kernels (what ``pretune-fla`` tunes)."""
        return self.gdn == "fla"

    def describe(self) -> str:
        mlp = f"recomputed tiles of {self.mlp_rows} rows" if self.mlp_rows else "whole"
        norm = f"recomputed tiles of {self.norm_rows} rows" if self.norm_rows else "whole"
        gdn = f"fla ({GDN_KERNELS[self.gdn_kernel]})" if self.gdn == "fla" else self.gdn
        return f"gated-deltanet={gdn}, attention={self.attention}, mlp={mlp}, rmsnorm={norm}"


# model.gdn_kernel -> what the header says. fla dispatches chunk_gated_delta_rule to FlashQLA by itself on SM90 when
# flash_qla imports and K = V = 128 (the 27B's shape); FLA_FLASH_QLA, read at every call, pins the choice.
GDN_KERNELS = {"triton": "its Triton delta rule, FlashQLA off", "flash_qla": "FlashQLA delta rule where its "
               "verifier takes the call (SM90/SM100, K = V = 128), else its Triton one"}
FLASH_QLA_ENV = "FLA_FLASH_QLA"


def pin_gdn_kernel(gdn_kernel: str) -> None:
    """Make fla's dispatcher take ``gdn_kernel`` for every chunked delta rule of this process."""
    if gdn_kernel not in GDN_KERNELS:
        raise ValueError(f"model.gdn_kernel: unknown kernel {gdn_kernel!r} ({' | '.join(GDN_KERNELS)})")
    if gdn_kernel == "flash_qla" and importlib.util.find_spec("flash_qla") is None:
        raise ValueError("model.gdn_kernel=flash_qla but the `flash_qla` package is not installed (FlashQLA, "
                         "QwenLM/FlashQLA); use model.gdn_kernel=triton")
    os.environ[FLASH_QLA_ENV] = "1" if gdn_kernel == "flash_qla" else "0"


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


# The tiles by device: packtrain.config.tiles, their one home
CPU_MLP_ROWS, CUDA_MLP_ROWS = TILE_ROWS["cpu"]["mlp"], TILE_ROWS["cuda"]["mlp"]
CPU_NORM_ROWS, CUDA_NORM_ROWS = TILE_ROWS["cpu"]["norm"], TILE_ROWS["cuda"]["norm"]


def select_backend(kernels: str, device: torch.device | str, attention: str | None = None,
                   mlp_chunk_rows: int | None = None, norm_chunk_rows: int | None = None,
                   gdn_kernel: str = "triton") -> Backend:
    """``kernels``: auto | torch | fla. ``auto`` takes fla on CUDA when it imports, else torch.
    ``mlp_chunk_rows`` (``train.mlp_chunk_rows``) and ``norm_chunk_rows`` (``train.norm_chunk_rows``): None takes the
    device's default tile, 0 runs them whole.
    ``gdn_kernel`` (``model.gdn_kernel``): fla's delta-rule kernel, pinned for the process (:func:`pin_gdn_kernel`)."""
    device = torch.device(device)
    cpu = device.type == "cpu"
    if mlp_chunk_rows is None:
        mlp_chunk_rows = CPU_MLP_ROWS if cpu else CUDA_MLP_ROWS
    if norm_chunk_rows is None:
        norm_chunk_rows = CPU_NORM_ROWS if cpu else CUDA_NORM_ROWS
    rows = {"mlp_rows": mlp_chunk_rows or None, "norm_rows": norm_chunk_rows or None}
    if kernels == "auto":
        kernels = "fla" if device.type == "cuda" and fla_available() else "torch"
    if kernels == "fla":
        if not fla_available():
            raise ValueError("model.kernels=fla but the `fla` package is not installed (pip install 'packtrain[fla]')")
        pin_gdn_kernel(gdn_kernel)
        if device.type == "cuda":
            return Backend(gdn="fla", attention=attention or "flex", gdn_kernel=gdn_kernel, **rows)
        from packtrain.packed.kernels import interpreter

        if not interpreter.interpreter_on():
            raise ValueError(f"model.kernels=fla on {device.type}: fla's Triton kernels run off CUDA only under "
                             "Triton's interpreter (slow, for tests): start with TRITON_INTERPRET=1 in the "
                             "environment, or use model.kernels=torch")
        interpreter.apply()
        return Backend(gdn="fla", attention=attention or "batched", gdn_kernel=gdn_kernel, **rows)
    if kernels == "torch":
        return Backend(gdn="torch", attention=attention or "batched", **rows)
    raise ValueError(f"model.kernels: unknown back end {kernels!r} (auto | torch | fla)")
