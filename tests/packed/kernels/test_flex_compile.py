"""FlexAttention over many pack lengths: one compilation (the bound is two), and the padded run equals the dense-mask
reference. CPU, forward without grad (FlexAttention has no CPU backward). Counted with a backend that records each
graph dynamo hands it and runs it eagerly: inductor's C++ compile of flex on CPU takes minutes (and its dynamic
variant fails there with CppCompileError), while the recompilations being bounded are dynamo's, decided by the
guards on the inputs' shapes. tests/packed/kernels/test_gpu.py counts them with inductor on CUDA."""

import torch
from tiny_models import random_pack

from packtrain.packed.attention import attention_dense
from packtrain.packed.kernels import flex
from packtrain.packed.layout import build_pack_layout

# Total pack lengths from one block to several, on and off the 128-token grid, shortest first (a first pack of one
# block is what used to pin the compilation to one block).
PACKS = [(3, [(0, 2)]), (20, [(5, 5), (1, 1)]), (100, [(20, 7)]), (64, [(30, 34)]), (90, [(20, 19), (0, 1)]),
         (200, [(40, 16)]), (150, [(50, 56), (1, 1)]), (300, [(100, 300), (0, 2)])]


def _count_compilations(monkeypatch) -> list:
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setattr(flex, "_compiled_flex",
                        torch.compile(flex._flex_attention, dynamic=True, backend=counting_backend))
    return graphs


def test_many_pack_lengths_compile_at_most_twice_and_equal_the_dense_reference(monkeypatch):
    graphs = _count_compilations(monkeypatch)
    g = torch.Generator().manual_seed(0)
    lengths = []
    for prefix_len, specs in PACKS:
        layout = build_pack_layout(*random_pack(prefix_len, specs, seed=prefix_len))
        T = layout.length
        lengths.append(T)
        q, k, v = torch.randn(1, 4, T, 16, generator=g), torch.randn(1, 2, T, 16, generator=g), torch.randn(
            1, 2, T, 16, generator=g)
        with torch.no_grad():
            got = flex.flex_attention(q, k, v, layout, 0.25, 0.0)
            ref = attention_dense(q, k, v, layout, 0.25, 0.0)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert len(set(lengths)) == len(PACKS) and min(lengths) < flex.FLEX_BLOCK and max(lengths) > 2 * flex.FLEX_BLOCK
    # The bound is two (a static then a dynamic compilation would do); padding to >= 2 whole blocks and marking the
    # block dimensions dynamic from the start gives one, and the unpadded, unmarked compile measured two here
    # (specialised to the first pack's single block, then "block_mask.q_indices size mismatch").
    assert len(graphs) == 1, f"{len(graphs)} compilations over pack lengths {lengths}"
