"""Shared-prefix attention (packtrain/packed/attention.py) against a pure-torch float64 reference that knows nothing
of layouts: each continuation's rows from an explicit softmax over ``concat(P, Ci)``, causal, alone; P's rows from
P alone. Every CPU path (the dense mask, the split attention merged by log-sum-exp, the padded buckets), the frozen
context's paths (P's keys from outside), grouped-query heads, and the gradients of q, k and v. The buckets' cut
against a brute-force search of every cut."""

import dataclasses
import itertools
import math

import pytest
import torch
from tiny_models import pack_layout

from packtrain.packed import attention

H, G, D = 4, 2, 8
SCALE = D ** -0.5


def _causal(q_HLD, k_GLD, v_GLD):
    """softmax(q k^T * SCALE) v over one sequence, causal, the key/value heads repeated to the query heads."""
    k, v = (x.repeat_interleave(H // G, dim=0) for x in (k_GLD, v_GLD))
    scores = q_HLD @ k.transpose(-1, -2) * SCALE
    L = scores.shape[-1]
    scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -math.inf)
    return scores.softmax(-1) @ v


def standalone_reference(q_1HTD, k_1GTD, v_1GTD, layout):
    """[1, H, T, D] in the buffer's order: P's rows from P alone, each continuation's from concat(P, Ci) alone."""
    p, cu = layout.prefix_len, layout.cu_seqlens_host
    q, k, v = q_1HTD[0], k_1GTD[0], v_1GTD[0]
    rows = [_causal(q[:, :p], k[:, :p], v[:, :p])]
    for a, b in zip(cu, cu[1:]):
        idx = torch.cat([torch.arange(p), torch.arange(p + a, p + b)])
        rows.append(_causal(q[:, idx], k[:, idx], v[:, idx])[:, p:])
    return torch.cat(rows, dim=1)[None]


def _qkv(T, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, T, D, generator=g, dtype=torch.float64, requires_grad=True) for n in (H, G, G)]


def _assert_same_with_grads(ours, ref, inputs, seed=7):
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-13)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got, want = (torch.autograd.grad((x * w).sum(), inputs) for x in (ours, ref))
    for name, a, b in zip("qkv", got, want):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=name)


SHAPES = [(5, [1]), (7, [3, 9, 2]), (40, [300, 4, 5, 4, 6, 5]), (3, [1, 64, 65, 30])]


@pytest.mark.parametrize("impl", ["dense", "split", "padded"])
@pytest.mark.parametrize("prefix_len, lengths", SHAPES, ids=lambda x: str(x))
def test_pack_attention_is_each_continuation_alone(prefix_len, lengths, impl, monkeypatch):
    """attention_dense (the predicate's [T, T] mask) and attention_batched's two CPU paths: the split attention
    (flash calls merged by log-sum-exp) and the padded buckets (where the flash op is missing, or with dropout)."""
    if impl == "padded":
        monkeypatch.setattr(attention, "_FLASH", None)
    layout = pack_layout(prefix_len, lengths)
    q, k, v = _qkv(layout.length, seed=prefix_len)
    fn = attention.attention_dense if impl == "dense" else attention.attention_batched
    _assert_same_with_grads(fn(q, k, v, layout, SCALE, 0.0), standalone_reference(q, k, v, layout), (q, k, v))


@pytest.mark.parametrize("impl", ["frozen_dense", "split", "padded"])
def test_frozen_attention_is_each_continuation_alone(impl, monkeypatch):
    """The frozen context's buffer holds only the continuations; P's keys and values come from outside (P's
    no_grad pass). Its rows equal the reference's continuation rows, and the gradients reach q, k and v of the
    continuations (P's keys get none here: they are constants)."""
    if impl == "padded":
        monkeypatch.setattr(attention, "_FLASH", None)
    layout = pack_layout(6, [2, 11, 5])
    p = layout.prefix_len
    q, k, v = _qkv(layout.length, seed=3)
    ref = standalone_reference(q, k, v, layout)[:, :, p:]
    args = [x[:, :, p:] for x in (q, k, v)] + [x[:, :, :p].detach() for x in (k, v)]
    view = dataclasses.replace(layout, input_ids=layout.input_ids[:, p:], position_ids=layout.position_ids[..., p:],
                               segment_ids=layout.segment_ids[p:], _cache={})  # the buffer without P's rows
    fn = attention.frozen_dense if impl == "frozen_dense" else attention.frozen_batched
    ours = fn(*args, view, SCALE, 0.0)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-13)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((ours * w).sum(), (q, k, v))
    # the reference with P's keys and values cut from the graph, as the frozen context has them
    k_ref, v_ref = (torch.cat([x[:, :, :p].detach(), x[:, :, p:]], dim=2) for x in (k, v))
    want = torch.autograd.grad((standalone_reference(q, k_ref, v_ref, layout)[:, :, p:] * w).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        assert b[:, :, p:].abs().max() > 0 and a[:, :, :p].eq(0).all(), name
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=name)


def _brute_force_cost(order, keys, rows):
    """The least padded work over every cut of ``order`` into contiguous runs (2^(n-1) of them)."""
    best = math.inf
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        runs, run = [], [order[0]]
        for i, cut in zip(order[1:], cuts):
            if cut:
                runs.append(run)
                run = []
            run.append(i)
        runs.append(run)
        best = min(best, _cost(runs, keys, rows))
    return best


def _cost(runs, keys, rows):
    return sum((len(r) * max(rows[i] for i in r) + attention._CALL_ROWS) * keys[r[0]] for r in runs)


@pytest.mark.parametrize("seed", range(6))
def test_cheapest_runs_is_the_least_padded_work_of_every_cut(seed):
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 120, (int(torch.randint(1, 9, (1,), generator=rng)),), generator=rng).tolist()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    keys = [50 + n for n in lengths]
    runs = attention.cheapest_runs(order, keys, lengths)
    assert [i for r in runs for i in r] == order  # contiguous runs of the order, every continuation once
    assert _cost(runs, keys, lengths) == _brute_force_cost(order, keys, lengths)


def test_attention_buckets_put_one_long_continuation_alone():
    lay = pack_layout(50, [300, 4, 5, 4, 6, 5])
    buckets, unpad = attention.attention_buckets(lay, lay.prefix_len)
    assert [tuple(b.index.shape) for b in buckets] == [(1, 300), (5, 6)]
    lay_equal = pack_layout(50, [8, 8, 8])
    assert [tuple(b.index.shape) for b in attention.attention_buckets(lay_equal, lay_equal.prefix_len)[0]] == [(3, 8)]


@pytest.mark.parametrize("path", ["split", "padded"])
@pytest.mark.parametrize("lengths", [[300, 4, 5, 4, 6, 5], [1, 64, 65, 30]])
def test_bucketed_attention_equals_dense_mask(lengths, path, monkeypatch):
    """Both CPU paths: P's keys and each bucket's own keys merged by log-sum-exp (split), and the padded buckets
    against [P ; own keys] with a mask (padded, taken where the flash op is missing or with attention dropout)."""
    if path == "padded":
        monkeypatch.setattr(attention, "_FLASH", None)
    lay = pack_layout(40, lengths)
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
