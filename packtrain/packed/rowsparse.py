"""kv_only's row-sparse backward (``packing.context_grad``, :mod:`packtrain.packed.context`): inside
:func:`rows_from`, every ``F.linear`` (base layers and LoRA A/B alike) runs over all rows in forward, bitwise the
dense call, and computes its backward over rows ``[start:]`` only, valid where the upstream gradient on the rows
before ``start`` is exactly zero.

``start`` is a buffer row. Inside a dense-MLP tile (:mod:`packtrain.packed.recompute`) rows count from the tile's
first row, set by :func:`tile_at`: none of a tile before ``start`` is kept, all of one after it. A checkpointed
tile's recompute runs in backward, outside the forward's mode and context variables, so it enters both again with
the values its forward read (:func:`active_start` and the tile's offset).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# The kept-row start of the row-sparse mode in force (None: dense), and the buffer row the MLP tile running now
# starts at.
_START: contextvars.ContextVar[int | None] = contextvars.ContextVar("packtrain_row_sparse_start", default=None)
_TILE_OFFSET: contextvars.ContextVar[int] = contextvars.ContextVar("packtrain_mlp_tile_offset", default=0)


class _RowSparseLinear(torch.autograd.Function):
    """``F.linear`` over all rows in forward; backward only over rows [start:] (dim -2)."""

    @staticmethod
    def forward(ctx, x, weight, bias, start):
        ctx.start, ctx.has_bias, ctx.rows = start, bias is not None, x.shape[-2]
        ctx.save_for_backward(x.narrow(-2, start, x.shape[-2] - start), weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x_k, weight = ctx.saved_tensors
        start, kept = ctx.start, ctx.rows - ctx.start
        g_k = grad.narrow(-2, start, kept)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # zero on P's rows; the kept rows' product written in place (no cat copy)
            dx = grad.new_empty(grad.shape[:-1] + (weight.shape[1],))
            dx.narrow(-2, 0, start).zero_()
            torch.matmul(g_k, weight, out=dx.narrow(-2, start, kept))
        if ctx.needs_input_grad[1]:
            dw = g_k.reshape(-1, g_k.shape[-1]).T @ x_k.reshape(-1, x_k.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g_k.reshape(-1, g_k.shape[-1]).sum(0)
        return dx, dw, db, None


class _RowSparse(TorchFunctionMode):
    def __init__(self, start: int):
        super().__init__()
        self.start = start

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            start = min(max(self.start - _TILE_OFFSET.get(), 0), x.shape[-2])
            return _RowSparseLinear.apply(x, weight, bias, start)
        return func(*args, **kwargs)


@contextlib.contextmanager
def rows_from(start: int | None):
    """The row-sparse backward inside, kept rows from buffer row ``start`` (None: dense). Entering it again with
    the same start in force changes nothing (a tile's forward runs inside its MLP's mode already)."""
    if start is None or _START.get() == start:
        yield
        return
    assert _START.get() is None, "row-sparse modes do not nest"
    token = _START.set(start)
    try:
        with _RowSparse(start):
            yield
    finally:
        _START.reset(token)


def active_start() -> int | None:
    """The kept-row start in force now (None: dense)."""
    return _START.get()


@contextlib.contextmanager
def tile_at(offset: int):
    """Rows inside count from buffer row ``offset`` (a dense-MLP tile's first row)."""
    token = _TILE_OFFSET.set(offset)
    try:
        yield
    finally:
        _TILE_OFFSET.reset(token)
