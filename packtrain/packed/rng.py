"""The RNG state a forward draws its random numbers (LoRA dropout masks) from, and drawing them again: a recompute
that starts from the saved state draws the forward's masks, as torch.utils.checkpoint's recompute does."""

from __future__ import annotations

import contextlib

import torch


def rng_state(device: torch.device):
    """The CPU generator's state and, for a CUDA device, that device's."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def replay(state, device: torch.device):
    """Inside, the generators start from ``state``; after, they are as they were before."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
