"""The fla back end's index plumbing (tailed varlen conv buffer, cu_seqlens, per-continuation initial states),
checked on CPU in float64 without fla installed: its two kernels are replaced by pure-torch varlen equivalents (a
loop over cu_seqlens segments of the torch reference); tests/packed/kernels/test_fla_interpreter*.py run fla's real
kernels. Everything packtrain does around them runs as on the GPU, and must equal the torch back end."""

import pytest
import torch
from fla_interp import fake_fla  # noqa: F401 - the fixture, used by name
from parity import packed_run, without_float32_casts
from tiny_models import patched_lora_model, random_pack

from packtrain.packed.kernels import Backend


@pytest.mark.usefixtures("fake_fla")
@pytest.mark.parametrize("prefix_len", [1, 2, 65])
def test_fla_plumbing_equals_torch_back_end(monkeypatch, prefix_len):
    with without_float32_casts(monkeypatch):
        prefix, conts = random_pack(prefix_len, [(0, 1), (3, 2), (70, 5), (10, 1)], seed=prefix_len)
        ref = packed_run(patched_lora_model(["linear_attention", "full_attention"], seed=5,
                                            backend=Backend("torch", "batched")), prefix, conts)
        got = packed_run(patched_lora_model(["linear_attention", "full_attention"], seed=5,
                                            backend=Backend("fla", "batched")), prefix, conts)
    assert torch.allclose(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-13, atol=0)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-10, atol=1e-13)


@pytest.mark.usefixtures("fake_fla")
@pytest.mark.parametrize("tree", [False, True], ids=["pack", "tree"])
def test_varlen_calls_get_int64_bounds_with_their_host_copy_built_once_per_layout(monkeypatch, tree):
    """Every varlen call of fla (the conv and the delta rule, in every GDN layer) gets int64 ``cu_seqlens`` and its
    host copy ``cu_seqlens_cpu`` (without it fla syncs with the device per call), the same tensors in every layer of
    one pack: built once per layout, so fla's own cache of what it derives from them hits."""
    import sys
    from collections import Counter

    fla_conv = sys.modules["fla.modules.causal_conv1d"]
    fla_rule = sys.modules["fla.ops.gated_delta_rule"]
    calls = []

    def spy(fn, kind):
        def run(*args, **kwargs):
            if kwargs.get("cu_seqlens") is not None:
                calls.append((kind, kwargs["cu_seqlens"], kwargs.get("cu_seqlens_cpu")))
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(fla_conv, "causal_conv1d", spy(fla_conv.causal_conv1d, "conv"))
    monkeypatch.setattr(fla_rule, "chunk_gated_delta_rule", spy(fla_rule.chunk_gated_delta_rule, "rule"))
    L, F = "linear_attention", "full_attention"
    model = patched_lora_model([L, F, L], seed=5, backend=Backend("fla", "batched"))
    if tree:  # P, then s -> {s a, s b -> {s b c, s b d}}: two levels of varlen runs
        from packtrain.packed.layout import Continuation
        from packtrain.packed.lm import PackedLM
        from packtrain.packed.lm import TreeCall
        from packtrain.packed.tree import build_tree_layout

        s = [11, 12, 13, 14, 15]
        conts = [Continuation(s + [20, 21], [22]), Continuation(s + [30, 31, 32], [33, 34]),
                 Continuation(s + [30, 31, 32, 40], [41]), Continuation(s, [50, 51])]
        PackedLM(model, "full", 0)(TreeCall(build_tree_layout([5, 6, 7], conts))).loss_sum.backward()
    else:
        prefix, conts = random_pack(5, [(0, 1), (3, 2), (70, 5), (10, 1)], seed=5)
        packed_run(model, prefix, conts)
    assert {kind for kind, _, _ in calls} == {"conv", "rule"}
    for kind, cu, cu_cpu in calls:
        assert cu.dtype == torch.long and cu_cpu is not None and cu_cpu.dtype == torch.long, kind
        assert cu_cpu.device.type == "cpu" and torch.equal(cu_cpu, cu.cpu()), kind
    uses = Counter(id(cu) for _, cu, _ in calls)
    assert set(uses.values()) == {2}, uses  # each bounds tensor reaches both GDN layers: built once, not per call
