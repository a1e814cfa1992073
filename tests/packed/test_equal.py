"""The equal-call rule's helpers (packtrain/packed/equal.py) on one rank: a dummy's silenced loss scale, the filler
calls that make a rank's count the due one, a loss anchored to a graph so its backward runs."""

import math

import pytest
import torch

from packtrain.distributed import DistInfo
from packtrain.packed.equal import anchored, filler_calls, silenced


@pytest.mark.parametrize("scale, expected", [(1.0, 0.0), (-3.5, 0.0), (0.0, 0.0)])
def test_silenced_is_zero(scale, expected):
    assert silenced(scale) == expected


@pytest.mark.parametrize("scale", [math.nan, math.inf])  # an injected NaN (or an overflow) shows on every rank
def test_silenced_keeps_a_nan_a_nan(scale):
    assert math.isnan(silenced(scale))


@pytest.mark.parametrize("made, due, calls", [(2, 5, 3), (5, 5, 0), (0, 1, 1)])
def test_filler_calls_make_up_the_due_count(made, due, calls):
    seen = []
    filler_calls(made, due, lambda: seen.append(1))
    assert len(seen) == calls


def test_anchored_gives_a_loss_without_a_graph_a_zero_gradient_path():
    anchor = torch.randn(3, requires_grad=True)
    loss = torch.tensor(2.5)
    out = anchored(loss, anchor * 2)
    assert out.requires_grad and torch.equal(out.detach(), loss)
    (grad,) = torch.autograd.grad(out, anchor)
    assert torch.equal(grad, torch.zeros(3))


def test_anchored_leaves_a_loss_with_a_graph_and_no_grad_mode_alone():
    anchor = torch.randn(3, requires_grad=True)
    own = (anchor ** 2).sum()
    assert anchored(own, anchor) is own
    loss = torch.tensor(1.0)
    with torch.no_grad():
        assert anchored(loss, anchor) is loss


