"""``packing.context_grad: kv_only``'s cut: the gradient of P's rows of every decoder-layer input is zero.

Forward is the identity (bitwise); in backward the rows ``[:start]`` (dim -2) get no gradient. The hooks sit on the
modules of the decoder-layer list, outside any checkpoint wrapper, so a recompute never sees them.
"""

from __future__ import annotations

import contextlib

import torch


class _CutRows(torch.autograd.Function):
    """Identity in forward; in backward the gradient of rows [:start] (dim -2) is zero."""

    @staticmethod
    def forward(ctx, x, start):
        ctx.start = start
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        kept = grad.narrow(-2, ctx.start, grad.shape[-2] - ctx.start)
        zeros = grad.new_zeros(grad.shape[:-2] + (ctx.start, grad.shape[-1]))
        return torch.cat([zeros, kept], dim=-2), None


def cut_rows(x: torch.Tensor, start: int) -> torch.Tensor:
    return _CutRows.apply(x, start)


@contextlib.contextmanager
def cut_at_layer_inputs(layers, start: int):
    """Cut the gradient of rows [:start] of every decoder layer's input. The hooks sit on the modules of the layer
    list (outside any checkpoint wrapper), so a recompute never sees them."""
    def hook(module, args):
        return (cut_rows(args[0], start),) + tuple(args[1:])

    handles = [layer.register_forward_pre_hook(hook) for layer in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
