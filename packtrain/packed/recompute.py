"""What the patched model recomputes in backward instead of keeping: dense-MLP tiles and RMSNorms
(:func:`packtrain.packed.patch.patch_model` installs both).

- A dense MLP over T rows makes three or four [T, intermediate] activations, and autograd keeps them all until the
  layer's backward. :func:`tiled_mlp` runs it in tiles of rows, each a non-reentrant checkpoint: a tile keeps only
  its input (a slice of the MLP's input, which the layer holds anyway) and its intermediates exist only while it
  runs, in forward and again in its recompute. Row by row the MLP is the same computation; the checkpoint restores
  the RNG state, so a LoRA dropout mask drawn in a tile is drawn again the same. Under kv_only the recompute enters
  the row-sparse mode again with the start and tile offset its forward saw (:mod:`packtrain.packed.rowsparse`).
- transformers' RMSNorms compute in float32 and keep float32 copies of their input and normalised output (8 bytes
  per element of a bf16 input). :func:`recomputed_norm` keeps only the norm's inputs and recomputes the same ops in
  backward, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from packtrain.packed.rowsparse import active_start, rows_from, tile_at


def _tile(forward, x, offset: int, start: int | None):
    with tile_at(offset), rows_from(start):
        return forward(x)


def tiled_mlp(forward, x: torch.Tensor, rows: int) -> torch.Tensor:
    """``forward`` (a dense MLP's own) over ``x`` [..., T, D] in tiles of ``rows`` rows; with grad enabled each tile is
    checkpointed (one tile when T <= rows)."""
    start, n = active_start(), x.shape[-2]
    out = []
    for offset in range(0, n, rows):
        tile = x.narrow(-2, offset, min(rows, n - offset))
        if torch.is_grad_enabled():
            out.append(checkpoint(_tile, forward, tile, offset, start, use_reentrant=False))
        else:
            out.append(_tile(forward, tile, offset, start))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-2)


def is_rmsnorm(module: nn.Module) -> bool:
    """transformers' RMSNorms of the supported families (``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated``,
    ``Qwen3NextRMSNorm``, ``Qwen3RMSNorm``, ...)."""
    return type(module).__name__.endswith(("RMSNorm", "RMSNormGated"))


def recomputed_norm(self: nn.Module, *args):
    """A norm's forward that keeps only its inputs for backward. The class's forward is looked up per call, so a
    replacement of it on the class applies."""
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args)
    return checkpoint(forward, self, *args, use_reentrant=False, preserve_rng_state=False)
