"""What the patched model recomputes in backward instead of keeping: dense-MLP tiles and RMSNorms
(:func:`packtrain.packed.patch.patch_model` installs both).

- A dense MLP over T rows makes three or four [T, intermediate] activations, and autograd keeps them all until the
  layer's backward. :func:`tiled_mlp` runs it in tiles of rows: in forward each tile's graph is dropped as soon as
  its output exists, and only the MLP's input is kept (which the layer holds anyway); backward runs each tile again
  from the RNG state its forward drew from (a LoRA dropout mask comes out the same) and takes that tile's gradient
  before the next, so one tile's intermediates exist at a time. Row by row the MLP is the same computation. Under
  kv_only the recompute enters the row-sparse mode again with the start and tile offset its forward saw
  (:mod:`packtrain.packed.rowsparse`). ALST's TiledMLP works the same way.
- transformers' RMSNorms compute in float32 and keep float32 copies of their input and normalised output (8 bytes
  per element of a bf16 input). :func:`recomputed_norm` keeps only the norm's inputs and recomputes the same ops in
  backward (a non-reentrant checkpoint), bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from packtrain.packed.rng import replay, rng_state
from packtrain.packed.rowsparse import active_start, rows_from, tile_at


def _tile(forward, x, offset: int, start: int | None):
    with tile_at(offset), rows_from(start):
        return forward(x)


class _Tiles(torch.autograd.Function):
    """The MLP ``forward`` over tiles of ``rows`` rows of ``x``; ``params``: the parameters it trains. ``forward``
    must draw the same random numbers with and without grad (dropout does): the recompute runs it with grad."""

    @staticmethod
    def forward(ctx, forward, rows: int, start: int | None, x, *params):
        ctx.forward, ctx.rows, ctx.start, ctx.rng = forward, rows, start, []
        out = []
        for offset in range(0, x.shape[-2], rows):  # under no_grad, as a Function's forward runs: nothing kept
            ctx.rng.append(rng_state(x.device))
            out.append(_tile(forward, _rows(x, offset, rows), offset, start))
        ctx.save_for_backward(x, *params)
        return torch.cat(out, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        dx = torch.empty_like(x) if need_x else None
        dparams = [None] * len(params)
        for i, offset in enumerate(range(0, x.shape[-2], ctx.rows)):
            tile = _rows(x.detach(), offset, ctx.rows).requires_grad_(need_x)
            with replay(ctx.rng[i], x.device), torch.enable_grad():
                y = _tile(ctx.forward, tile, offset, ctx.start)
            inputs = ([tile] if need_x else []) + list(params)
            grads = torch.autograd.grad(y, inputs, _rows(grad, offset, ctx.rows), allow_unused=True)
            if need_x:
                _rows(dx, offset, ctx.rows).copy_(grads[0])
                grads = grads[1:]
            dparams = [g if d is None else d if g is None else d.add_(g) for d, g in zip(dparams, grads)]
        return None, None, None, dx, *dparams


def _rows(t: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    return t.narrow(-2, offset, min(rows, t.shape[-2] - offset))


def tiled_mlp(module: nn.Module, forward, x: torch.Tensor, rows: int) -> torch.Tensor:
    """``forward`` (``module``'s own) over ``x`` [..., T, D] in tiles of ``rows`` rows, recomputed in backward when
    grad is enabled (one tile when T <= rows)."""
    start = active_start()
    params = [p for p in module.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and (x.requires_grad or params):
        return _Tiles.apply(forward, rows, start, x, *params)
    out = [_tile(forward, _rows(x, offset, rows), offset, start) for offset in range(0, x.shape[-2], rows)]
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
