"""Layer-input offload through the chunk pool: same maths, fixed-size chunks, flat pool memory."""

import pytest
import torch
from tiny_models import random_pack, tiny_lora_model

from packtrain.models.offload import ChunkPool
from packtrain.models.wrap import wrap
from packtrain.packed.kernels import Backend
from packtrain.packed.layout import build_pack_layout
from packtrain.packed.lm import PackCall

L, F = "linear_attention", "full_attention"
BACKEND = Backend(gdn="torch", attention="batched")


def _run(lm, prefix, conts):
    lm.zero_grad(set_to_none=True)
    out = lm(PackCall(build_pack_layout(prefix, conts)))
    out.loss_sum.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
             for n, p in lm.named_parameters() if p.requires_grad}
    return out.per_example.tolist(), grads


@pytest.mark.parametrize("checkpointing,offload", [(True, False), (False, True), (True, True)],
                         ids=["checkpoint", "offload", "both"])
def test_offload_and_checkpointing_change_nothing(checkpointing, offload):
    prefix, conts = random_pack(65, [(0, 1), (70, 5), (10, 2)], seed=7)
    plain = wrap(tiny_lora_model([L, F, L], seed=3), BACKEND)
    wrapped = wrap(tiny_lora_model([L, F, L], seed=3), BACKEND, checkpointing=checkpointing, offload=offload,
                      chunk_bytes=4096)
    la, ga = _run(plain, prefix, conts)
    lb, gb = _run(wrapped, prefix, conts)
    assert la == lb
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n
    state_keys = wrapped.state_dict().keys()
    assert not [k for k in state_keys if "_checkpoint_wrapped_module" in k]  # adapters save under plain names


def test_chunks_are_ceil_of_size_not_a_power_of_two():
    pool = ChunkPool(chunk_bytes=1000)
    assert pool.chunks_for(1) == 1
    assert pool.chunks_for(1000) == 1
    assert pool.chunks_for(1001) == 2  # just over one chunk: one extra chunk, not double the size
    assert pool.chunks_for(3000) == 3
    assert pool.chunks_for(3001) == 4  # a power-of-two rounding would take 4096 bytes' worth... and 8 at 4097
    assert pool.chunks_for(4097) == 5


def test_pool_memory_stays_flat_across_steps():
    prefix, conts = random_pack(40, [(5, 3), (30, 4)], seed=9)
    lm = wrap(tiny_lora_model([L, F, L, L], seed=4), BACKEND, offload=True, chunk_bytes=2048)
    pool = next(m.pool for m in lm.modules() if hasattr(m, "pool"))
    sizes = []
    for _ in range(4):
        _run(lm, prefix, conts)
        assert pool.in_use == 0  # backward handed every chunk back
        sizes.append(pool.allocated_bytes)
    layer_input = build_pack_layout(prefix, conts).length * 32 * 8  # T x hidden x float64
    assert sizes[0] == 4 * pool.chunks_for(layer_input) * 2048  # 4 layers alive at once, each ceil(bytes/chunk)
    assert sizes == [sizes[0]] * 4  # reused: no growth after the first step


def test_no_grad_skips_the_offload():
    prefix, conts = random_pack(10, [(5, 3)], seed=1)
    lm = wrap(tiny_lora_model([L, F], seed=4), BACKEND, offload=True)
    pool = next(m.pool for m in lm.modules() if hasattr(m, "pool"))
    with torch.no_grad():
        lm(PackCall(build_pack_layout(prefix, conts)))
    assert pool.allocated == 0
