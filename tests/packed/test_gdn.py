"""Gated DeltaNet on a pack (packtrain/packed/gdn.py) against each sequence computed alone, in float64: the conv
over history-laid rows against F.conv1d on ``concat(P, Ci)``, the delta rule (P from the zero state, every
continuation from P's final state) against the token-by-token recurrence on ``concat(P, Ci)``, outputs, final
states and gradients; the conv's row index and each continuation's conv tail as literal tables."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import pack_layout

from packtrain.packed import gdn
from packtrain.packed.kernels import torch_ref


@pytest.mark.parametrize("prefix_len", [2, 9])  # shorter and longer than the conv's W-1 = 3 history rows
def test_conv_over_history_rows_equals_conv_of_each_standalone_sequence(prefix_len):
    """Outputs, and the gradients of the input, the weight and the bias, against F.conv1d on each standalone
    sequence under autograd."""
    lay = pack_layout(prefix_len, [1, 7, 2, 12])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(lay.length, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    out = gdn.packed_conv_torch(x, w, b, lay)
    p, cu = lay.prefix_len, lay.cu_seqlens_host
    ref = [torch_ref.causal_conv_silu(x[:p].T[None], w, b)[0].T]
    for a, e in zip(cu, cu[1:]):
        alone = torch.cat([x[:p], x[p + a:p + e]])
        ref.append(F.silu(F.conv1d(alone.T[None], w[:, None], b, padding=3, groups=5)[0, :, :alone.shape[0]]).T[p:])
    ref = torch.cat(ref)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-14)
    up = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (x, w, b), up)
    for got, want in zip(grads, torch.autograd.grad(ref, (x, w, b), up)):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("prefix_len, lengths, rows, keep", [
    # P rows 0-2 after two zero rows (-1); each continuation after P's last two rows (1, 2)
    (3, [2, 3], [-1, -1, 0, 1, 2, 1, 2, 3, 4, 1, 2, 5, 6, 7], [0, 1, 2, 5, 6, 9, 10, 11]),
    # P shorter than the history: a zero row, then P's one row, before the continuation
    (1, [2], [-1, -1, 0, -1, 0, 1, 2], [0, 3, 4]),
])
def test_conv_rows_table(prefix_len, lengths, rows, keep):
    """Width 3: every segment after its W-1 = 2 rows of history (buffer indices, -1 a zero row); ``keep`` the
    outputs of real tokens (output r reads rows r..r+2)."""
    got_rows, got_keep = gdn.conv_rows(pack_layout(prefix_len, lengths), 3)
    assert got_rows.tolist() == rows and got_keep.tolist() == keep


@pytest.mark.parametrize("lengths, chunk", [([10], 16), ([256, 3], 16), ([257], 32), ([5, 300, 1], 32)])
def test_continuation_chunk_table(lengths, chunk):
    assert gdn.continuation_chunk(lengths) == chunk


def _heads(T, seed, H=2, HV=4, K=8, V=6):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=g, dtype=torch.float64)
    k = torch.randn(T, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(T, HV, V, generator=g, dtype=torch.float64)
    gate = -torch.rand(T, HV, generator=g, dtype=torch.float64)  # log decay <= 0
    beta = torch.rand(T, HV, generator=g, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, gate, beta)]


def _alone(inputs, rows):
    """The recurrence on the buffer's ``rows`` as one sequence from the zero state: (output [L, HV, V], final)."""
    out, final = torch_ref.recurrent_gated_delta_rule(*(x[rows][None] for x in inputs))
    return out[0], final


# P over two of its 32-row chunks; continuations over the short chunk's edges, and one past 256 (the long chunk)
@pytest.mark.parametrize("prefix_len, lengths", [(40, [1, 17, 33]), (5, [300, 16, 2]), (1, [1])])
def test_delta_rule_is_each_continuation_from_p_alone(prefix_len, lengths):
    layout = pack_layout(prefix_len, lengths)
    p, cu = layout.prefix_len, layout.cu_seqlens_host
    inputs = _heads(layout.length, seed=prefix_len)
    ours = gdn.packed_delta_rule_torch(*inputs, layout)
    ref = [_alone(inputs, torch.arange(p))[0]]
    for a, b in zip(cu, cu[1:]):
        ref.append(_alone(inputs, torch.cat([torch.arange(p), torch.arange(p + a, p + b)]))[0][p:])
    ref = torch.cat(ref)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got, want = (torch.autograd.grad((x * w).sum(), inputs) for x in (ours, ref))
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got, want):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


def test_continuations_from_a_given_state_end_in_each_ones_own_final_state():
    """What a generation's item pass and the frozen context run: the buffer holds only the continuations, from P's
    state given from outside; each continuation's final state is concat(P, Ci)'s alone."""
    layout = pack_layout(7, [3, 20, 1])
    p, cu = layout.prefix_len, layout.cu_seqlens_host
    inputs = _heads(layout.length, seed=2)
    _, state = _alone(inputs, torch.arange(p))
    out, finals = gdn.continuation_delta_rule_torch(*(x[p:] for x in inputs), layout, state, final_state=True)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        ref_out, ref_final = _alone(inputs, torch.cat([torch.arange(p), torch.arange(p + a, p + b)]))
        torch.testing.assert_close(out[a:b], ref_out[p:], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(finals[i], ref_final[0], rtol=1e-10, atol=1e-12)


def test_continuation_tails_are_each_ones_last_inputs_after_p():
    """[N, C, W-1] from the conv's input [P's W-1 tail ; continuations]: a continuation shorter than W-1 ends in
    P's tail."""
    layout = pack_layout(6, [1, 5, 2])
    cu, width, h = layout.cu_seqlens_host, 4, 3
    conv_in = torch.randn(h + cu[-1], 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tails = gdn.continuation_tails(conv_in, layout, width)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        alone = torch.cat([conv_in[:h], conv_in[h + a:h + b]])
        assert torch.equal(tails[i], alone[-h:].T)
