"""Layer-input offload through the chunk pool: same maths (whole and partial), fixed-size chunks, flat pool memory,
and in backward each offloaded input copied back ahead of its layer, on a side stream the compute stream waits for
by an event (the order checked through a stream object that records it)."""

import contextlib

import pytest
import torch
from tiny_models import random_pack, tiny_lora_model

from packtrain.models.offload import ChunkPool, OffloadChain, OffloadedCheckpoint, SyncStreams
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


@pytest.mark.parametrize("checkpointing,offload", [(True, 0), (False, 3), (True, 3), (True, 1), (False, 2)],
                         ids=["checkpoint", "offload", "both", "first layer offloaded", "two of three offloaded"])
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
    lm = wrap(tiny_lora_model([L, F, L, L], seed=4), BACKEND, offload=4, chunk_bytes=2048)
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
    lm = wrap(tiny_lora_model([L, F], seed=4), BACKEND, offload=2)
    pool = next(m.pool for m in lm.modules() if hasattr(m, "pool"))
    with torch.no_grad():
        lm(PackCall(build_pack_layout(prefix, conts)))
    assert pool.allocated == 0


def test_partial_offload_takes_chunks_for_its_layers_only():
    """train.offload: 2 of 4 layers: the pool holds the first two layers' inputs; the other two stay on the device."""
    prefix, conts = random_pack(40, [(5, 3), (30, 4)], seed=9)
    lm = wrap(tiny_lora_model([L, F, L, L], seed=4), BACKEND, offload=2, chunk_bytes=2048)
    layers = [m for m in lm.modules() if isinstance(m, OffloadedCheckpoint)]
    assert [m.offload for m in layers] == [True, True, False, False]
    _run(lm, prefix, conts)
    layer_input = build_pack_layout(prefix, conts).length * 32 * 8
    assert layers[0].pool.allocated_bytes == 2 * layers[0].pool.chunks_for(layer_input) * 2048


class RecordingStreams(SyncStreams):
    """A stream object that records, in order, the copies' side stream being entered, its events and the compute
    stream's waits; the CPU waiting on anything is an error."""

    def __init__(self, log):
        self.log = log
        self.events = 0

    def side(self):
        self.log.append("side")
        return contextlib.nullcontext()

    def record(self):
        self.events += 1
        self.log.append(f"event {self.events}")
        return self.events

    def compute_waits(self, event):
        self.log.append(f"compute waits {event}")


def _ordered_run(offloaded: int, layers: int):
    """One forward and backward with ``offloaded`` of ``layers`` layers offloaded: the log of the side stream, its
    events and the compute stream's waits, each layer's recompute start and end of backward."""
    log = []
    model = tiny_lora_model([L, F, L, L][:layers], seed=4)
    lm = wrap(model, BACKEND)
    from packtrain.packed.patch import text_parts

    text_model, _ = text_parts(model)
    chain = OffloadChain(ChunkPool(2048), RecordingStreams(log))
    for i, layer in enumerate(text_model.layers):
        inner = layer
        text_model.layers[i] = OffloadedCheckpoint(layer, chain, i, offload=i < offloaded)

        def started(module, args, i=i):
            if torch._C._current_graph_task_id() != -1:
                log.append(f"recompute {i}")

        inner.register_forward_pre_hook(started)
        inner.register_full_backward_hook(lambda m, gi, go, i=i: log.append(f"backward {i} done"))
    prefix, conts = random_pack(20, [(5, 3), (9, 4)], seed=2)
    out = lm(PackCall(build_pack_layout(prefix, conts)))
    log.append("backward")
    out.loss_sum.backward()
    return log[log.index("backward") + 1:], log[:log.index("backward")]


def test_backward_prefetches_the_layer_before_while_a_layer_runs(monkeypatch):
    """Three layers, all offloaded: when layer i's recompute starts, layer i - 1's input is copied on the side stream
    (an event marks it) before layer i computes; layer i - 1's recompute makes the compute stream wait for that
    event, after layer i's backward; the CPU never waits (no synchronize anywhere)."""
    def no_cpu_wait(*a, **k):
        raise AssertionError("the CPU waited")

    monkeypatch.setattr(torch.cuda, "synchronize", no_cpu_wait)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", no_cpu_wait)
    backward, forward = _ordered_run(3, 3)
    assert forward == ["side"] * 3  # the copies out: one per layer, on the side stream, no event waited on
    assert backward == [
        "side", "event 1", "compute waits 1",  # layer 2: nothing prefetched it; copied now and waited for
        "side", "event 2",  # layer 1's input starts back while layer 2 runs
        "recompute 2", "backward 2 done",
        "compute waits 2",  # layer 1's recompute waits for its copy's event
        "side", "event 3",  # and starts layer 0's
        "recompute 1", "backward 1 done",
        "compute waits 3", "recompute 0", "backward 0 done"]


def test_the_first_kept_layer_prefetches_the_last_offloaded_one():
    """Two of four layers offloaded: layer 2 keeps its input on the device, and its recompute starts layer 1's copy
    back; layer 3 starts nothing."""
    backward, forward = _ordered_run(2, 4)
    assert forward == ["side"] * 2
    assert backward == ["recompute 3", "backward 3 done",
                        "side", "event 1", "recompute 2", "backward 2 done",
                        "compute waits 1", "side", "event 2", "recompute 1", "backward 1 done",
                        "compute waits 2", "recompute 0", "backward 0 done"]
