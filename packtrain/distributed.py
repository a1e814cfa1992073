"""Rank, world size and device from the launcher's environment (torchrun and ``accelerate launch`` set the
same variables), and the few collectives the trainer needs. One process without a launcher is rank 0 of 1."""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any process group exists: its collectives take ``group=group.WORLD`` as a default argument,
# so importing it later (peft does) pins the default group in those defaults for good, destroy_process_group
# cannot free it, and gloo's worker threads live on into interpreter shutdown (see shutdown()).
import torch.distributed.nn

from packtrain.exits import Stalled


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_pref: str = "auto", timeout_s: float | None = None) -> DistInfo:
    """``timeout_s`` (``ops.collective_timeout``): how long the rendezvous and each collective may wait."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is visible")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
        try:
            dist.init_process_group(backend="nccl" if use_cuda else "gloo", rank=rank, world_size=world, **timeout)
        except dist.DistStoreError as e:  # the rendezvous timed out: a rank never started or cannot connect
            raise Stalled(f"rank {rank}: the {world} ranks did not meet within ops.collective_timeout="
                          f"{timeout_s} s at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                          f"({e}); check that every rank started and can reach that address") from None
    return DistInfo(rank, world, local_rank, device)


def all_reduce_max_tensor(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group once every rank is done with it, so that gloo's worker threads are joined
    before the interpreter exits. Called from the commands' ``finally``.

    Why: a gloo worker releases a finished collective's tensors after the caller's ``wait()`` has returned, and
    releasing a tensor that has a Python object takes the GIL. When the main thread reached interpreter shutdown
    first (``check-nodes`` does within microseconds of its last all_gather), the worker was killed inside a C++
    destructor: "terminate called without an active exception", SIGABRT (3 of 16 runs). The barrier makes every
    rank finish with the group (its own work holds no Python tensor, and the GIL is free while it waits),
    ``gc.collect`` drops model cycles that still reference the group, and releasing the last reference runs
    ProcessGroupGloo's destructor, which joins the worker threads. No barrier while an exception is on its way
    out: another rank may never reach it.
    """
    if not dist.is_initialized():
        return
    if sys.exc_info()[0] is None:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()
