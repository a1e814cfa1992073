"""The CPU back end's varlen paths against independent references, in float64: the varlen chunk rule against the
token-by-token recurrence per sequence, the conv over history-laid rows against a conv of concat(P, Ci), and the
length-bucketed attention against the dense mask built straight from the predicate."""

import pytest
import torch
import torch.nn.functional as F

from packtrain.packed import attention, gdn
from packtrain.packed.kernels import torch_ref
from packtrain.packed.layout import Continuation, build_pack_layout

LENGTHS = [[1], [64], [65], [1, 64, 65, 3, 130, 64, 2]]


def _sequences(lengths, seed=0, H=2, HV=4, K=8, V=6):
    g = torch.Generator().manual_seed(seed)
    S, n = sum(lengths), len(lengths)
    q = torch.randn(1, S, H, K, generator=g, dtype=torch.float64)
    k = torch.randn(1, S, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(1, S, HV, V, generator=g, dtype=torch.float64)
    gate = -torch.rand(1, S, HV, generator=g, dtype=torch.float64)
    beta = torch.rand(1, S, HV, generator=g, dtype=torch.float64)
    h0 = torch.randn(n, HV, K, V, generator=g, dtype=torch.float64)  # a different initial state per sequence
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return [x.requires_grad_() for x in (q, k, v, gate, beta, h0)], cu


@pytest.mark.parametrize("chunk", [64, 32, 16])  # 64: P's and fla's chunk; 16: the continuations' (gdn.py)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda ls: "-".join(map(str, ls)))
def test_varlen_chunk_rule_equals_recurrence_per_sequence(lengths, chunk):
    (q, k, v, gate, beta, h0), cu = _sequences(lengths)
    out, final = torch_ref.chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=h0, output_final_state=True,
                                                  cu_seqlens=torch.tensor(cu, dtype=torch.int32), chunk_size=chunk)
    refs, ref_finals = [], []
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        o, s = torch_ref.recurrent_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], gate[:, a:b], beta[:, a:b],
                                                    initial_state=h0[i:i + 1])
        refs.append(o)
        ref_finals.append(s)
    ref, ref_final = torch.cat(refs, 1), torch.cat(ref_finals)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final, ref_final, rtol=1e-10, atol=1e-12)
    # backward, through the shrinking scan and into every sequence's own initial state
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    wf = torch.randn(final.shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    inputs = (q, k, v, gate, beta, h0)
    ours = torch.autograd.grad((out * w).sum() + (final * wf).sum(), inputs)
    theirs = torch.autograd.grad((ref * w).sum() + (ref_final * wf).sum(), inputs)
    for name, a, b in zip("q k v g beta h0".split(), ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


def test_varlen_chunk_rule_from_one_shared_state_equals_padded_batch():
    """What a pack runs: every continuation from P's state (broadcast), varlen vs the padded-batch rule."""
    lengths = [5, 70, 64, 1]
    (q, k, v, gate, beta, h0), cu = _sequences(lengths, seed=1)
    shared = h0[:1].expand(len(lengths), -1, -1, -1)
    out, _ = torch_ref.chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=shared, cu_seqlens=cu)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        alone, _ = torch_ref.chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], gate[:, a:b], beta[:, a:b],
                                                    initial_state=h0[:1])
        torch.testing.assert_close(out[:, a:b], alone, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("cu", [[0, 3, 3, 10], [1, 10], [0, 9]])
def test_varlen_chunk_rule_rejects_bad_cu_seqlens(cu):
    (q, k, v, gate, beta, _), _ = _sequences([10])
    with pytest.raises(ValueError, match="cu_seqlens"):
        torch_ref.chunk_gated_delta_rule(q, k, v, gate, beta, cu_seqlens=cu)


def test_varlen_chunk_plan_table():
    # lengths 3, 130, 64 in chunks of 64: 1, 3 and 1 chunks; ranked 130 first; step 0 holds all three
    gather, scatter, active, order = torch_ref.varlen_chunk_plan([3, 130, 64], 64, "cpu")
    assert order == [1, 0, 2] and active == [3, 1, 1]
    rows = gather.view(-1, 64)
    assert rows[0, :3].tolist() == [3, 4, 5]  # step 0, rank 0: the 130-token sequence's first chunk
    assert rows[1, :3].tolist() == [0, 1, 2] and rows[1, 3:].eq(197).all()  # rank 1: 3 tokens, then padding
    assert rows[4, :2].tolist() == [131, 132] and rows[4, 2:].eq(197).all()  # step 2: tokens 128-129 of 130
    assert torch.equal(gather[scatter], torch.arange(197))


def _pack(prefix_len, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    conts = [Continuation(torch.randint(1, 50, (n - n // 2,), generator=g).tolist(),
                          torch.randint(1, 50, (n // 2 or 1,), generator=g).tolist()[:max(n // 2, 1)])
             for n in lengths]
    return build_pack_layout(list(range(1, prefix_len + 1)), conts)


@pytest.mark.parametrize("prefix_len", [2, 9])  # shorter and longer than the conv's W-1 = 3 history rows
def test_conv_over_history_rows_equals_conv_of_each_standalone_sequence(prefix_len):
    """Outputs, and the gradients of the input, the weight and the bias, against F.conv1d on each standalone
    sequence under autograd."""
    lay = _pack(prefix_len, [1, 7, 2, 12])
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


def test_attention_buckets_put_one_long_continuation_alone():
    lay = _pack(50, [300, 4, 5, 4, 6, 5])
    buckets, unpad = attention.attention_buckets(lay, lay.prefix_len)
    assert [tuple(b.index.shape) for b in buckets] == [(1, 300), (5, 6)]
    lay_equal = _pack(50, [8, 8, 8])
    assert [tuple(b.index.shape) for b in attention.attention_buckets(lay_equal, lay_equal.prefix_len)[0]] == [(3, 8)]


@pytest.mark.parametrize("path", ["split", "padded"])
@pytest.mark.parametrize("lengths", [[300, 4, 5, 4, 6, 5], [1, 64, 65, 30]])
def test_bucketed_attention_equals_dense_mask(lengths, path, monkeypatch):
    """Both CPU paths: P's keys and each bucket's own keys merged by log-sum-exp (split), and the padded buckets
    against [P ; own keys] with a mask (padded, taken where the flash op is missing or with attention dropout)."""
    if path == "padded":
        monkeypatch.setattr(attention, "_FLASH", None)
    lay = _pack(40, lengths)
    g = torch.Generator().manual_seed(4)
    T = lay.length
    q = torch.randn(1, 4, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ours = attention.attention_batched(q, k, v, lay, 8 ** -0.5, 0.0)
    ref = attention.attention_dense(q, k, v, lay, 8 ** -0.5, 0.0)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-13)
    w = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((ours * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)
