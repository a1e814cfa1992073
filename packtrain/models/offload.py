"""Activation checkpointing per decoder layer with the layer input offloaded to host memory, in fixed-size chunks,
and copied back ahead of need.

With checkpointing, a layer keeps only its input for the recompute: 64 layers x 0.67 GiB at 70K tokens is 43 GiB
on the device. Here the inputs of the first N layers (``train.offload: N``; all with ``true``) are copied to host
memory during forward; the other layers keep theirs on the device. The intermediates recomputed inside a layer stay
on the device.

Host memory comes from a :class:`ChunkPool` of equal chunks (default 64 MiB, pinned on CUDA). A tensor takes
ceil(bytes / chunk) chunks, never a power-of-two rounding (PyTorch's pinned caching allocator turns a 1.01 GiB
request into a 2 GiB block); chunks return to the pool when backward has read them, so layers and steps reuse
them and the pool stays as large as the largest set of layer inputs alive at once.

How the input leaves the device: a non-reentrant checkpoint keeps its inputs alive for the recompute. So the
checkpoint is given a 1-element *key* instead of the hidden states: ``_Stash`` copies the hidden states to the
pool and returns the key; inside the checkpointed function ``_Fetch`` turns the key back into the hidden states
(the original tensor on the first pass, a copy from the pool in the recompute). The gradient of the hidden
states travels from ``_Fetch.backward`` to ``_Stash.backward`` through the slot on the device, never through
the host.

How it comes back (:class:`OffloadChain`): backward runs the layers last to first, and when layer i's recompute
starts, layer i - 1's input (if offloaded) is copied to the device on a side stream, so the copy runs while layer i
recomputes and backpropagates; layer i - 1's recompute then makes the compute stream wait on the copy's event (the
CPU never waits). The copies out in forward run on the same side stream, after the compute stream's work so far,
so a chunk is never overwritten while a copy still reads it. The device holds one prefetched input beyond the running
layer's. Off CUDA (and under ``plan --measure``'s fake tensors) the same steps run synchronously
(:class:`SyncStreams`), so the memory pattern is CUDA's.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_BYTES = 64 * 2**20


class ChunkPool:
    """Equal host-memory chunks handed out and taken back; allocates only when every chunk is in use."""

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, pin_memory: bool = False):
        self.chunk_bytes = chunk_bytes
        self.pin_memory = pin_memory
        self._free: list[torch.Tensor] = []
        self.allocated = 0  # chunks ever allocated (the pool's size)
        self.in_use = 0

    @property
    def allocated_bytes(self) -> int:
        return self.allocated * self.chunk_bytes

    def chunks_for(self, nbytes: int) -> int:
        return max(1, math.ceil(nbytes / self.chunk_bytes))

    def take(self, n: int) -> list[torch.Tensor]:
        out = []
        for _ in range(n):
            if not self._free:
                self.allocated += 1  # first: a counter of device memory reads the pool's size as host memory
                self._free.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pin_memory))
            out.append(self._free.pop())
        self.in_use += n
        return out

    def give_back(self, chunks: list[torch.Tensor]) -> None:
        self.in_use -= len(chunks)
        self._free.extend(chunks)


class SyncStreams:
    """The copies' streams off CUDA: one stream, everything in order, nothing to wait on."""

    non_blocking = False

    def side(self):
        """A context in which copies are issued (the side stream)."""
        return contextlib.nullcontext()

    def after_compute(self) -> None:
        """The side stream waits for the compute stream's work issued so far (a copy out reads a fresh tensor)."""

    def record(self):
        """An event on the side stream marking the copies issued so far (none here)."""

    def compute_waits(self, event) -> None:
        """The compute stream waits for ``event`` (the CPU does not)."""

    def used_by_side(self, t: torch.Tensor) -> None:
        """``t``, made on the compute stream, is read on the side stream: kept until that read is done."""

    def used_by_compute(self, t: torch.Tensor) -> None:
        """``t``, made on the side stream, is read on the compute stream."""


class CudaStreams(SyncStreams):
    """One side stream per device for every copy of the offload, out and back."""

    non_blocking = True

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def side(self):
        return torch.cuda.stream(self.stream)

    def after_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self):
        return self.stream.record_event()

    def compute_waits(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def used_by_side(self, t: torch.Tensor) -> None:
        t.record_stream(self.stream)

    def used_by_compute(self, t: torch.Tensor) -> None:
        t.record_stream(torch.cuda.current_stream(self.device))


class OffloadChain:
    """The offloaded slots of the forwards whose backward has not run, by (forward, layer); what prefetches layer
    i - 1's input when layer i's recompute starts. A forward is the layers called in increasing order: a layer
    index not above the last one seen starts the next forward."""

    def __init__(self, pool: ChunkPool, streams: SyncStreams | None = None):
        self.pool = pool
        self._streams = streams
        self._forward = 0
        self._last_layer = None
        self._slots: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def streams(self, device: torch.device) -> SyncStreams:
        if self._streams is None:
            cuda = device.type == "cuda" and self.pool.pin_memory
            self._streams = CudaStreams(device) if cuda else SyncStreams()
        return self._streams

    def enter(self, layer: int) -> int:
        """A layer's forward with grad starts: the forward it belongs to."""
        if self._last_layer is not None and layer <= self._last_layer:
            self._forward += 1
        self._last_layer = layer
        return self._forward

    def keep(self, forward: int, layer: int, slot: _Slot) -> None:
        self._slots[(forward, layer)] = slot

    def recompute_starts(self, forward: int, layer: int) -> None:
        """Layer ``layer``'s recompute in backward begins: copy the input of the layer before it back now."""
        slot = self._slots.pop((forward, layer - 1), None)
        if slot is not None:
            slot.prefetch()


class _Slot:
    """One layer input on its way to the host and back, and the gradient coming back for it."""

    def __init__(self, chain: OffloadChain):
        self.chain = chain
        self.pool = chain.pool
        self.chunks: list[torch.Tensor] = []
        self.meta = None
        self.original: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.fetched: torch.Tensor | None = None  # the prefetched copy on the device
        self.fetched_event = None

    def store(self, x: torch.Tensor) -> None:
        self.original = x
        self.meta = (x.shape, x.dtype, x.device)
        flat = x.detach().contiguous().view(-1).view(torch.uint8)
        self.chunks = self.pool.take(self.pool.chunks_for(flat.numel()))
        streams = self.chain.streams(x.device)
        streams.after_compute()
        with streams.side():  # beside the layer's forward
            for i, chunk in enumerate(self.chunks):
                piece = flat[i * self.pool.chunk_bytes:(i + 1) * self.pool.chunk_bytes]
                chunk[:piece.numel()].copy_(piece, non_blocking=streams.non_blocking)
        streams.used_by_side(flat)

    def first_pass(self) -> torch.Tensor:
        """The original tensor, for the forward; afterwards only the host copy remains."""
        x, self.original = self.original, None
        return x

    def prefetch(self) -> None:
        """Start the copy back to the device on the side stream (the chunks' copies out come first on it)."""
        if self.fetched is not None or not self.chunks:
            return
        shape, dtype, device = self.meta
        streams = self.chain.streams(device)
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        with streams.side():
            flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            for i, chunk in enumerate(self.chunks):
                piece = flat[i * self.pool.chunk_bytes:(i + 1) * self.pool.chunk_bytes]
                piece.copy_(chunk[:piece.numel()], non_blocking=streams.non_blocking)
            self.fetched_event = streams.record()
        self.fetched = flat

    def load(self) -> torch.Tensor:
        """The input on the device, for the recompute: the prefetched copy once the compute stream has waited for
        it (or the copy made now, when nothing prefetched it)."""
        self.prefetch()
        shape, dtype, device = self.meta
        streams = self.chain.streams(device)
        streams.compute_waits(self.fetched_event)
        flat, self.fetched, self.fetched_event = self.fetched, None, None
        streams.used_by_compute(flat)
        return flat.view(dtype).view(shape)

    def release(self) -> None:
        if self.chunks:
            self.pool.give_back(self.chunks)
            self.chunks = []


class _Stash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot):
        slot.store(x)
        ctx.slot = slot
        return x.new_zeros(1)

    @staticmethod
    def backward(ctx, _grad_key):
        slot = ctx.slot
        grad, slot.grad = slot.grad, None
        slot.release()
        return grad, None


class _Fetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, key, slot):
        ctx.slot = slot
        x = slot.first_pass() if slot.original is not None else slot.load()
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.slot.grad = grad
        return torch.zeros(1, dtype=grad.dtype, device=grad.device), None


def _in_backward() -> bool:
    """Whether autograd's engine runs this call (a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


class OffloadedCheckpoint(ActivationWrapper):
    """Decoder layer ``index``, checkpointed, with its input offloaded to the chain's pool while backward has not
    reached it (``offload``), or kept on the device as a plain checkpoint keeps it; either way its recompute tells
    ``chain`` to prefetch the layer before it.

    An ``ActivationWrapper`` like torch's checkpoint wrapper, so state dicts keep the unwrapped names."""

    def __init__(self, layer: nn.Module, chain: OffloadChain, index: int, offload: bool = True):
        super().__init__(layer)
        self.chain, self.index, self.offload = chain, index, offload

    @property
    def pool(self) -> ChunkPool:
        return self.chain.pool

    def forward(self, hidden_states, *args, **kwargs):
        layer = self._checkpoint_wrapped_module
        if not torch.is_grad_enabled() or not hidden_states.requires_grad:
            return layer(hidden_states, *args, **kwargs)
        forward = self.chain.enter(self.index)

        def starts():
            if _in_backward():
                self.chain.recompute_starts(forward, self.index)

        if not self.offload:
            def run_kept(h, *a, **kw):
                starts()
                return layer(h, *a, **kw)

            return checkpoint(run_kept, hidden_states, *args, use_reentrant=False, **kwargs)
        slot = _Slot(self.chain)
        key = _Stash.apply(hidden_states, slot)
        self.chain.keep(forward, self.index, slot)

        def run(k, *a, **kw):
            h = _Fetch.apply(k, slot)
            starts()
            return layer(h, *a, **kw)

        return checkpoint(run, key, *args, use_reentrant=False, **kwargs)
