"""The shape-only stand-ins of fla's GDN kernels (packtrain/memory/fla_shapes.py) against fla itself, run on CPU under
Triton's interpreter: the same outputs and the same tensors saved for backward (what ``plan --measure`` counts), a
backward that gives every input its gradient's shape, and the stand-ins put in place and taken out again."""

import pytest
import torch
from fla_interp import fla_cpu_backend, needs_interpreter

from packtrain.memory import fla_shapes

T, H, HV, K, V = 66, 1, 2, 16, 8  # value heads: two per key head, as in Qwen3.6
CU = torch.tensor([0, 2, 66])  # two sequences: 1 + 1 chunks of 64


def _delta_rule_inputs() -> list[torch.Tensor]:
    """bfloat16 inputs, as a bf16 model passes them (fla keeps the gate's cumsum and the rstds in float32), and
    P's state in float32."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, T, H, K, generator=g), torch.randn(1, T, H, K, generator=g)
    v = torch.randn(1, T, HV, V, generator=g)
    gate, beta = -torch.rand(1, T, HV, generator=g) * 0.5, torch.rand(1, T, HV, generator=g)
    h0 = torch.randn(len(CU) - 1, HV, K, V, generator=g)
    bf16 = [x.bfloat16() for x in (q, k, v, gate, beta)]
    return [x.requires_grad_() for x in (*bf16, h0)]


def _saved(fn, *args, **kwargs):
    """(fn's outputs, the (shape, dtype) of each distinct floating tensor it saves for backward). fla also saves
    the index tensors of cu_seqlens (int64, a few numbers) and beta twice (before and after an optional sigmoid)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        out = fn(*args, **kwargs)
    distinct = {t.data_ptr(): t for t in saved if t.is_floating_point()}.values()
    return out, sorted((tuple(t.shape), str(t.dtype)) for t in distinct)


@needs_interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy bfloat16 overflows: values unread
def test_the_delta_rule_stand_in_saves_what_fla_saves():
    fla_cpu_backend()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    kw = {"output_final_state": True, "use_qk_l2norm_in_kernel": True, "cu_seqlens": CU}
    q, k, v, g, beta, h0 = _delta_rule_inputs()
    (o, final), fla_saved = _saved(chunk_gated_delta_rule, q, k, v, g, beta, initial_state=h0, **kw)
    inputs = _delta_rule_inputs()
    q, k, v, g, beta, h0 = inputs
    (o2, final2), saved = _saved(fla_shapes.chunk_gated_delta_rule, q, k, v, g, beta, initial_state=h0, **kw)
    assert saved == fla_saved
    assert (o2.shape, o2.dtype, final2.shape, final2.dtype) == (o.shape, o.dtype, final.shape, final.dtype)
    (o2.sum() + final2.sum()).backward()
    assert [x.grad.shape for x in inputs] == [x.shape for x in inputs]


@needs_interpreter
def test_the_conv_stand_in_saves_what_fla_saves():
    fla_cpu_backend()
    from fla.modules.causal_conv1d import causal_conv1d

    g = torch.Generator().manual_seed(1)
    x, weight, bias = torch.randn(1, T, 24, generator=g), torch.randn(24, 4, generator=g), torch.randn(24, generator=g)
    inputs = [t.requires_grad_() for t in (x, weight, bias)]
    (out, _), fla_saved = _saved(causal_conv1d, x=x, weight=weight, bias=bias, activation="silu", cu_seqlens=CU)
    (out2, _), saved = _saved(fla_shapes.causal_conv1d, x=x, weight=weight, bias=bias, activation="silu",
                              cu_seqlens=CU)
    assert saved == fla_saved and (out2.shape, out2.dtype) == (out.shape, out.dtype)
    x.grad = weight.grad = bias.grad = None
    out2.sum().backward()
    assert [t.grad.shape for t in inputs] == [t.shape for t in inputs]


def test_chunks_are_counted_per_sequence():
    assert fla_shapes._chunks(100, torch.tensor([0, 70, 100])) == 3 and fla_shapes._chunks(100, None) == 2
    assert fla_shapes._chunks(129, torch.tensor([0, 1, 65, 129])) == 1 + 1 + 1


def test_replaced_puts_the_originals_back_even_after_an_error():
    class Module:
        f, g = "f", "g"

    with pytest.raises(RuntimeError), fla_shapes.replaced([(Module, "f", 1), (Module, "g", 2)]):
        assert (Module.f, Module.g) == (1, 2)
        raise RuntimeError
    assert (Module.f, Module.g) == ("f", "g")
