"""The shape-only stand-in of FlexAttention (packtrain/memory/flex_shapes.py; FlexAttention has no CPU backward to
compare it with): its output, what it saves for backward (q, k, v, the output and the float32 log-sum-exp), gradients
of the inputs' shapes, and the stand-in put where packtrain calls the compiled kernel for the block only."""

import torch

from packtrain.memory import flex_shapes


def test_the_stand_in_saves_q_k_v_its_output_and_a_float32_log_sum_exp():
    B, H, HKV, T, D, Dv = 1, 4, 2, 256, 16, 8
    q = torch.randn(B, H, T, D, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, HKV, T, D, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, HKV, T, Dv, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        out = flex_shapes.flex_attention(q, k, v, block_mask=None, enable_gqa=True)
    assert (out.shape, out.dtype) == ((B, H, T, Dv), torch.bfloat16)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [
        ((B, H, T, D), torch.bfloat16), ((B, HKV, T, D), torch.bfloat16), ((B, HKV, T, Dv), torch.bfloat16),
        ((B, H, T, Dv), torch.bfloat16), ((B, H, T), torch.float32)]
    assert saved[0] is q and saved[3] is out
    out.float().sum().backward()
    assert [x.grad.shape for x in (q, k, v)] == [x.shape for x in (q, k, v)]


def test_installed_stands_in_for_the_compiled_kernel_for_the_block_only():
    from packtrain.packed.kernels import flex

    compiled, create = flex._compiled_flex, flex._create
    with flex_shapes.installed():
        assert flex._compiled_flex is flex_shapes.flex_attention and flex._create(None, 128, "cpu") is None
    assert (flex._compiled_flex, flex._create) == (compiled, create)
