"""Activation checkpointing per decoder layer with the layer input offloaded to host memory, in fixed-size chunks.

With checkpointing, a layer keeps only its input for the recompute: 64 layers x 0.67 GiB at 70K tokens is 43 GiB
on the device. Here that input is copied to host memory during forward and copied back when backward reaches
the layer; the intermediates recomputed inside the layer stay on the device.

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
"""

from __future__ import annotations

import math

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
                self._free.append(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pin_memory))
                self.allocated += 1
            out.append(self._free.pop())
        self.in_use += n
        return out

    def give_back(self, chunks: list[torch.Tensor]) -> None:
        self.in_use -= len(chunks)
        self._free.extend(chunks)


class _Slot:
    """One layer input on its way to the host and back, and the gradient coming back for it."""

    def __init__(self, pool: ChunkPool):
        self.pool = pool
        self.chunks: list[torch.Tensor] = []
        self.meta = None
        self.original: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.copy_done = None

    def store(self, x: torch.Tensor) -> None:
        self.original = x
        self.meta = (x.shape, x.dtype, x.device)
        flat = x.detach().contiguous().view(-1).view(torch.uint8)
        self.chunks = self.pool.take(self.pool.chunks_for(flat.numel()))
        non_blocking = x.device.type == "cuda" and self.pool.pin_memory
        stream = None
        if non_blocking:  # copy on a side stream so it overlaps the layer's compute
            stream = torch.cuda.Stream(device=x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            for i, chunk in enumerate(self.chunks):
                piece = flat[i * self.pool.chunk_bytes:(i + 1) * self.pool.chunk_bytes]
                chunk[:piece.numel()].copy_(piece, non_blocking=non_blocking)
        if stream is not None:
            self.copy_done = stream.record_event()
            x.record_stream(stream)

    def first_pass(self) -> torch.Tensor:
        """The original tensor, for the forward; afterwards only the host copy remains."""
        x, self.original = self.original, None
        return x

    def load(self) -> torch.Tensor:
        shape, dtype, device = self.meta
        if self.copy_done is not None:
            self.copy_done.synchronize()
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for i, chunk in enumerate(self.chunks):
            piece = flat[i * self.pool.chunk_bytes:(i + 1) * self.pool.chunk_bytes]
            piece.copy_(chunk[:piece.numel()], non_blocking=device.type == "cuda" and self.pool.pin_memory)
        return flat.view(dtype).view(shape)

    def release(self) -> None:
        if self.chunks:
            self.pool.give_back(self.chunks)
            self.chunks = []


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


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


class OffloadedCheckpoint(ActivationWrapper):
    """A decoder layer, checkpointed, with its input offloaded to ``pool`` while backward has not reached it.

    An ``ActivationWrapper`` like torch's checkpoint wrapper, so state dicts keep the unwrapped names."""

    def __init__(self, layer: nn.Module, pool: ChunkPool):
        super().__init__(layer)
        self.pool = pool

    def forward(self, hidden_states, *args, **kwargs):
        layer = self._checkpoint_wrapped_module
        if not torch.is_grad_enabled() or not hidden_states.requires_grad:
            return layer(hidden_states, *args, **kwargs)
        slot = _Slot(self.pool)
        key = _Stash.apply(hidden_states, slot)

        def run(k, *a, **kw):
            return layer(_Fetch.apply(k, slot), *a, **kw)

        return checkpoint(run, key, *args, use_reentrant=False, **kwargs)
