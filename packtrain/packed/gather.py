"""Gathers and sums over rows that come out the same bit for bit on every run: each sum adds its terms in the order
the index gives them, whatever the thread count or device.

Advanced indexing's backward (``index_put_(accumulate=True)``) adds a row's terms in parallel on CPU when torch has
more than one thread (``cpu_atomic_add_float``), and ``index_add_`` does on CUDA (atomics): a row that several
places read gets its gradient summed in an order that changes from run to run, so two runs of one config, or a
resumed and an uninterrupted run, train different adapters. A prefix tree's buckets read P's keys once per run of
nodes and a level's runs read their parents' states once per child. Here the terms are sorted by row (stably, so a
row's terms keep their order) and each row's run is summed in sequence (``torch.segment_reduce``), which equals a
serial ``index_add_`` bit for bit (tests/packed/test_gather.py) and costs about what the parallel one does. (The
loss's per-example sums need no sort: each example's target rows lie together, packed/loss.py.)"""

from __future__ import annotations

import torch


def segment_sum(values: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """``zeros(rows, ...).index_add_(0, index, values)`` with each row's terms added in index order: [rows, ...]."""
    ordered, order = torch.sort(index, stable=True)
    counts = torch.searchsorted(ordered, torch.arange(rows + 1, device=index.device)).diff()
    return torch.segment_reduce(values.index_select(0, order), "sum", lengths=counts, axis=0)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index):
        flat = index.reshape(-1)
        ctx.save_for_backward(flat)
        ctx.rows, ctx.index_dims = x.shape[0], index.dim()
        return x.index_select(0, flat).view(*index.shape, *x.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        (flat,) = ctx.saved_tensors
        grad = grad.reshape(flat.numel(), *grad.shape[ctx.index_dims:])
        return segment_sum(grad, flat, ctx.rows), None


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` (rows of ``x``, any index shape), whose backward sums the gradient of a row read several times
    with :func:`segment_sum`."""
    return _GatherRows.apply(x, index)


__all__ = ["gather_rows", "segment_sum"]
