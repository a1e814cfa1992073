"""A shape-only stand-in for FlexAttention, for ``plan --memory --measure`` under fake tensors.

FlexAttention has no CPU backward, and compiling it on fake tensors is not what the measurement wants: the CUDA step
runs it on the padded q, k and v of :mod:`packtrain.packed.kernels.flex` (whole 128-token blocks), and its autograd
function saves those three, its output and the float32 log-sum-exp [B, H, T] (torch 2.13's
``FlexAttentionAutogradOp``; the block mask's index tensors are the layout's). Its backward makes the gradients of
q, k and v and the float32 delta (the rows' sum of output x output gradient). :func:`installed` puts the stand-in
where packtrain calls the compiled kernel (the pack's attention and the frozen context's), and skips building the
block mask, which the stand-in does not read.
"""

from __future__ import annotations

import contextlib

import torch

from packtrain.memory.fla_shapes import replaced


class _Flex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, _ = q.shape
        out = q.new_empty(B, H, T, v.shape[-1])
        lse = q.new_empty(B, H, T, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, lse = ctx.saved_tensors
        delta = torch.empty_like(lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del delta
        return dq, dk, dv


def flex_attention(query, key, value, block_mask=None, scale=None, enable_gqa=False, **unused):
    return _Flex.apply(query, key, value)


@contextlib.contextmanager
def installed():
    """The compiled FlexAttention replaced by the stand-in where packtrain calls it, and its block masks not built;
    restored on exit."""
    from packtrain.packed.kernels import flex

    places = [(flex, "_compiled_flex", flex_attention), (flex, "_create", lambda *a, **k: None)]
    try:
        from packtrain.packed.kernels import fla_frozen
    except ImportError:  # the frozen context's CUDA path needs fla (plan --measure asks for it anyway)
        fla_frozen = None
    if fla_frozen is not None:
        places += [(fla_frozen, "_compiled_flex", flex_attention), (fla_frozen, "_block_mask", lambda *a, **k: None)]
    with replaced(places):
        yield
