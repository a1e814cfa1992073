"""What the patched model recomputes in backward instead of keeping: dense-MLP tiles and RMSNorm tiles
(:func:`packtrain.packed.patch.patch_model` installs both, where the back end's ``mlp_rows`` / ``norm_rows`` ask).

- A dense MLP over T rows makes three or four [T, intermediate] activations, and autograd keeps them all until the
  layer's backward. :func:`tiled_mlp` runs it in tiles of rows: in forward each tile's graph is dropped as soon as
  its output exists, and only the MLP's input is kept (which the layer holds anyway); backward runs each tile again
  from the RNG state its forward drew from (a LoRA dropout mask comes out the same) and takes that tile's gradient
  before the next, so one tile's intermediates exist at a time. Row by row the MLP is the same computation. Under
  kv_only the recompute enters the row-sparse mode again with the start and tile offset its forward saw
  (:mod:`packtrain.packed.rowsparse`). ALST's TiledMLP works the same way.
- transformers' RMSNorms compute in float32 and keep float32 copies of their input and normalised output (8 bytes
  per element of a bf16 input), and their backward makes six float32 pieces of the input's shape. :func:`tiled_norm`
  keeps only the norm's inputs (and a gated norm's gate) and runs the same ops tile by tile of rows, forward and
  backward (bit for bit: a norm is a row's own computation), so its float32 pieces exist one tile at a time.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from packtrain.packed.rng import replay, rng_state
from packtrain.packed.rowsparse import active_start, rows_from, tile_at


def _tile(forward, tiles, offset: int, start: int | None, rowsparse: bool):
    if not rowsparse:
        return forward(*tiles)
    with tile_at(offset), rows_from(start):
        return forward(*tiles)


class _Tiles(torch.autograd.Function):
    """``forward`` over tiles of ``rows`` rows (dim -2) of its ``n`` tiled inputs; ``params``: the parameters it
    trains. With ``rng`` (the MLP: LoRA dropout) each tile's RNG state is kept and replayed in the recompute, which
    runs ``forward`` with grad: it must draw the same random numbers with and without grad (dropout does);
    ``rowsparse`` (the MLP) enters kv_only's row-sparse mode per tile (the norms hold no linear)."""

    @staticmethod
    def forward(ctx, forward, rows: int, n: int, start: int | None, rng: bool, rowsparse: bool, *tensors):
        xs, params = tensors[:n], tensors[n:]
        ctx.forward, ctx.rows, ctx.n, ctx.start, ctx.rowsparse = forward, rows, n, start, rowsparse
        ctx.rng = [] if rng else None
        out = []
        for offset in range(0, xs[0].shape[-2], rows):  # under no_grad, as a Function's forward runs: nothing kept
            if rng:
                ctx.rng.append(rng_state(xs[0].device))
            out.append(_tile(forward, [_rows(x, offset, rows) for x in xs], offset, start, rowsparse))
        ctx.save_for_backward(*xs, *params)
        return torch.cat(out, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        xs, params = saved[:ctx.n], saved[ctx.n:]
        need = [ctx.needs_input_grad[6 + i] for i in range(ctx.n)]
        dxs = [torch.empty_like(x) if needed else None for x, needed in zip(xs, need)]
        dparams = [None] * len(params)
        device = xs[0].device
        for i, offset in enumerate(range(0, xs[0].shape[-2], ctx.rows)):
            tiles = [_rows(x.detach(), offset, ctx.rows).requires_grad_(needed) for x, needed in zip(xs, need)]
            replaying = replay(ctx.rng[i], device) if ctx.rng is not None else contextlib.nullcontext()
            with replaying, torch.enable_grad():
                y = _tile(ctx.forward, tiles, offset, ctx.start, ctx.rowsparse)
            inputs = [t for t, needed in zip(tiles, need) if needed] + list(params)
            grads = torch.autograd.grad(y, inputs, _rows(grad, offset, ctx.rows), allow_unused=True)
            del y
            grads = _write_rows([dx for dx in dxs if dx is not None], grads, offset, ctx.rows)
            dparams = [g if d is None else d if g is None else d.add_(g) for d, g in zip(dparams, grads)]
        return None, None, None, None, None, None, *dxs, *dparams


def _write_rows(dxs, grads, offset: int, rows: int):
    """The tile's input gradients written into their rows of ``dxs`` (and let go: the next tile's backward runs
    without them); returns the parameters' gradients."""
    for dx, g in zip(dxs, grads):
        tile = _rows(dx, offset, rows)
        tile.copy_(g) if g is not None else tile.zero_()
    return grads[len(dxs):]


def _rows(t: torch.Tensor, offset: int, rows: int) -> torch.Tensor:
    return t.narrow(-2, offset, min(rows, t.shape[-2] - offset))


def tiled_mlp(module: nn.Module, forward, x: torch.Tensor, rows: int) -> torch.Tensor:
    """``forward`` (``module``'s own) over ``x`` [..., T, D] in tiles of ``rows`` rows, recomputed in backward when
    grad is enabled (one tile when T <= rows)."""
    start = active_start()
    params = [p for p in module.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and (x.requires_grad or params):
        return _Tiles.apply(forward, rows, 1, start, True, True, x, *params)
    out = [_tile(forward, [_rows(x, offset, rows)], offset, start, True) for offset in range(0, x.shape[-2], rows)]
    return out[0] if len(out) == 1 else torch.cat(out, dim=-2)


def is_rmsnorm(module: nn.Module) -> bool:
    """transformers' RMSNorms of the supported families (``Qwen3_5RMSNorm``, ``Qwen3_5RMSNormGated``,
    ``Qwen3NextRMSNorm``, ``Qwen3RMSNorm``, ...)."""
    return type(module).__name__.endswith(("RMSNorm", "RMSNormGated"))


def tiled_norm(self: nn.Module, rows: int, width: int, *args):
    """A norm's forward (``args``: its input, and a gated norm's gate, [..., D] each) in tiles, recomputed tile by
    tile in backward: a tile holds as many elements as ``rows`` rows of ``width`` (the hidden size), so a norm over a
    head's width takes ``rows * width // D`` of its own rows. The class's forward is looked up per call, so a
    replacement of it on the class applies."""
    forward = type(self).forward
    x = args[0]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(tensors) != len(args) or any(t.shape != x.shape for t in tensors):
        return forward(self, *args)  # not a row-wise call (no gate given as a tensor of the input's shape)
    D = x.shape[-1]
    flat = [t.reshape(-1, D) for t in tensors]
    tile = max(1, rows * width // D)
    params = [p for p in self.parameters() if p.requires_grad]

    def run(*tiles):
        return forward(self, *tiles)

    if torch.is_grad_enabled() and (any(t.requires_grad for t in flat) or params):
        out = _Tiles.apply(run, tile, len(flat), None, False, False, *flat, *params)
    else:
        pieces = [run(*[_rows(t, offset, tile) for t in flat]) for offset in range(0, flat[0].shape[0], tile)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out.reshape(x.shape)
