"""kv_only's cut (packtrain/packed/cut.py): forward the identity bit for bit, backward the gradient of rows
[:start] zero and every other row's untouched, on one tensor and at every decoder-layer input of a stack, and the
hooks gone after the block."""

import pytest
import torch

from packtrain.packed.cut import cut_at_layer_inputs, cut_rows


def _rows_grad(x, f, w):
    (grad,) = torch.autograd.grad((f(x) * w).sum(), x)
    return grad


@pytest.mark.parametrize("start", [0, 3, 7])  # nothing cut, some rows, every row
def test_cut_rows_is_the_identity_with_p_rows_gradient_zero(start):
    g = torch.Generator().manual_seed(start)
    x = torch.randn(2, 7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 7, 5, generator=g, dtype=torch.float64)
    assert torch.equal(cut_rows(x, start), x)
    full, cut = _rows_grad(x, torch.sin, w), _rows_grad(x, lambda t: torch.sin(cut_rows(t, start)), w)
    assert cut[:, :start].eq(0).all() and torch.equal(cut[:, start:], full[:, start:])


def test_cut_at_layer_inputs_cuts_every_layer_and_is_removed_after():
    """Two row-wise layers: inside the block no gradient reaches P's rows through either layer's input; the rows
    after P get exactly the uncut gradient; after the block the hooks are gone."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4).double() for _ in range(2)])
    x = torch.randn(1, 6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 6, 4, dtype=torch.float64)

    def stack(t):
        for layer in layers:
            t = torch.tanh(layer(t))
        return t

    full = _rows_grad(x, stack, w)
    with cut_at_layer_inputs(layers, 2):
        cut = _rows_grad(x, stack, w)
        weight_grads = torch.autograd.grad((stack(x) * w).sum(), [p for p in layers.parameters()])
    assert cut[:, :2].eq(0).all() and torch.allclose(cut[:, 2:], full[:, 2:], rtol=1e-14, atol=0)
    assert all(g.abs().max() > 0 for g in weight_grads)  # the layers' own weights still learn from P's rows
    assert torch.equal(_rows_grad(x, stack, w), full)
    assert all(not layer._forward_pre_hooks for layer in layers)
