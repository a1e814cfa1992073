"""Rank, world size and device from the launcher's environment (torchrun and ``accelerate launch`` set the
same variables), and the few collectives the trainer needs. One process without a launcher is rank 0 of 1."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from packtrain.stops import Stalled


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
    if dist.is_initialized():
        dist.destroy_process_group()
