"""kv_only's row-sparse backward (packtrain/packed/rowsparse.py): inside ``rows_from(start)`` every ``F.linear``
gives the dense forward bit for bit, and, where the upstream gradient is zero on the rows before ``start`` (what
kv_only guarantees), the dense gradients of its input, weight and bias (float64), P's rows of the input's exactly
zero; a tile's rows count from its offset; the modes do not nest."""

import pytest
import torch
import torch.nn.functional as F

from packtrain.packed.rowsparse import active_start, rows_from, tile_at


def _two_layers(seed=0):
    """A base layer with bias and a LoRA-shaped pair (A then B, no bias), float64."""
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    a, bb = torch.randn(2, 5, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g, dtype=torch.float64)
    params = [p.requires_grad_() for p in (w, b, a, bb)]
    return params, lambda x: F.linear(x, w, b) + F.linear(F.linear(x, a), bb)


def _grads(x, layers, up, start=None, offset=0):
    params, f = layers
    with rows_from(start), tile_at(offset):
        out = f(x)
    return out, torch.autograd.grad(out, [x, *params], up)


@pytest.mark.parametrize("start", [0, 3, 9])  # nothing cut, P's rows, every row
def test_row_sparse_linear_is_the_dense_one_where_ps_rows_get_no_gradient(start):
    layers = _two_layers()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(1, 9, 6, generator=g, dtype=torch.float64)
    up[:, :start] = 0  # kv_only: no gradient reaches P's rows of a layer's output
    dense_out, dense = _grads(x, layers, up)
    out, sparse = _grads(x, layers, up, start)
    assert torch.equal(out, dense_out)
    assert sparse[0][:, :start].eq(0).all()
    for name, a, b in zip(("x", "w", "b", "A", "B"), sparse, dense):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14, msg=name)


def test_a_tiles_rows_count_from_its_offset():
    """A tile of rows 4-7 of the buffer with kept rows from buffer row 6: its first two rows are P's."""
    layers = _two_layers(2)
    x = torch.randn(1, 4, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(1, 4, 6, dtype=torch.float64)
    _, (dx, *_) = _grads(x, layers, up, start=6, offset=4)
    _, (dense_dx, *_) = _grads(x, layers, up)
    assert dx[:, :2].eq(0).all() and torch.allclose(dx[:, 2:], dense_dx[:, 2:], rtol=1e-13, atol=0)


def test_modes_do_not_nest_and_the_same_start_again_is_no_new_mode():
    assert active_start() is None
    with rows_from(3):
        assert active_start() == 3
        with rows_from(3):  # a tile's forward inside its MLP's mode
            assert active_start() == 3
        with pytest.raises(AssertionError, match="do not nest"), rows_from(5):
            pass
    assert active_start() is None
    with rows_from(None):
        assert active_start() is None
