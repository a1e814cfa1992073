"""What a run's memory savings must fit (:class:`Budget`): one GPU's memory less a reserve for what lies outside
PyTorch's allocator (or, on the CPU, the host's available memory shared by the node's ranks), and the host memory one
node's offload pools may take; at run time agreed by every rank, in ``plan`` from ``--gpu-memory``,
``--ranks-per-node`` and ``--host-memory-per-node``. No torch at import."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

from packtrain.memory.estimate import GiB

# The device memory the choice leaves free on CUDA: the CUDA context (~0.5 GiB) and NCCL's buffers (0.5-2 GiB) lie
# outside PyTorch's allocator, and its caching reserves 2-5% above what is allocated with expandable segments, 5-20%
# without (docs/performance.md, "Memory").
RESERVE_FIXED_BYTES = 2 * GiB
RESERVE_FRACTION = 0.05
# `plan --memory` without --gpu-memory on a config for CUDA: an 80 GiB GPU (H100), said in the output
ASSUMED_GPU_GIB = 80.0
# ranks per node when --ranks-per-node is not given (an 8-GPU node; on the CPU one process per machine)
DEFAULT_RANKS_PER_NODE = {"cuda": 8, "cpu": 1}


def device_reserve(total_bytes: int) -> int:
    """What the choice and ``--gpu-memory``'s budget search keep free of a GPU's ``total_bytes``."""
    return RESERVE_FIXED_BYTES + math.ceil(RESERVE_FRACTION * total_bytes)


# -- the budget ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    """What the choice must fit. ``device_bytes``: one GPU's (or, on the CPU, one rank's) memory after the reserve;
    ``host_per_node``: the host memory one node's offload pools may take (None: unknown, not limited)."""
    device: str  # "cuda" | "cpu"
    device_bytes: int | None  # None: unknown, not limited
    device_total: int | None
    reserve: int
    device_source: str
    host_per_node: int | None
    host_source: str
    ranks_per_node: int

    def as_json(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        each = "per GPU" if self.device == "cuda" else "per rank"
        if self.device_bytes is None:
            have = f"device memory unknown ({self.device_source})"
        else:
            shared = f", shared by {self.ranks_per_node} ranks" if self.device == "cpu" and self.ranks_per_node > 1 \
                else ""
            have = (f"{self.device_bytes / GiB:.2f} GiB {each} ({self.device_source}: {self.device_total / GiB:.2f} "
                    f"GiB less a {self.reserve / GiB:.2f} GiB reserve{shared})")
        host = ("host memory not limited" if self.host_per_node is None
                else f"{self.host_per_node / GiB:.2f} GiB of host memory per node")
        return f"{have}; {host} ({self.host_source}), {self.ranks_per_node} rank{'s' * (self.ranks_per_node != 1)} " \
               "per node"


def available_host_memory() -> int | None:
    """MemAvailable of this machine (bytes), None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _device_kind(cfg) -> str:
    return "cpu" if cfg.train.device == "cpu" else "cuda"


def _host_limit(given_gib: float | None, cfg, fallback: int | None, fallback_source: str) -> tuple[int | None, str]:
    if given_gib is not None:
        return int(given_gib * GiB), "--host-memory-per-node"
    if cfg.ops.host_memory_per_node_gib is not None:
        return int(cfg.ops.host_memory_per_node_gib * GiB), "ops.host_memory_per_node_gib"
    return fallback, fallback_source


def plan_budget(cfg, world_size: int, gpu_memory_gib: float | None = None, ranks_per_node: int | None = None,
                host_memory_per_node_gib: float | None = None) -> Budget:
    """``plan``'s budget: ``--gpu-memory`` (else this machine's available memory under ``train.device: cpu``, else
    an assumed 80 GiB GPU), the host memory of ``--host-memory-per-node`` (else ``ops.host_memory_per_node_gib``,
    else not limited) shared by ``--ranks-per-node`` ranks (else up to 8 on CUDA, 1 on the CPU)."""
    device = _device_kind(cfg)
    ranks = ranks_per_node or min(world_size, DEFAULT_RANKS_PER_NODE[device])
    if ranks < 1:
        raise ValueError(f"--ranks-per-node: must be at least 1, got {ranks}")
    host, host_source = _host_limit(host_memory_per_node_gib, cfg, None, "--host-memory-per-node GIB: not given")
    if gpu_memory_gib is not None:
        total = int(gpu_memory_gib * GiB)
        reserve = device_reserve(total)
        return Budget("cuda", max(0, total - reserve), total, reserve, f"--gpu-memory {gpu_memory_gib:g}", host,
                      host_source, ranks)
    if device == "cpu":
        return _cpu_budget(available_host_memory(), ranks, "this machine's available memory (train.device cpu)",
                           host, host_source)
    total = int(ASSUMED_GPU_GIB * GiB)
    reserve = device_reserve(total)
    return Budget("cuda", total - reserve, total, reserve, f"{ASSUMED_GPU_GIB:g} GiB assumed: --gpu-memory GIB "
                  "gives the GPU's", host, host_source, ranks)


def run_budget(cfg, info) -> Budget:
    """The budget of a run on ``info``'s device, the same on every rank (the smallest GPU and the smallest node's
    memory of all ranks, one all-reduce): CUDA, the device's memory less :func:`device_reserve` and the node's
    available host memory (or ``ops.host_memory_per_node_gib``) for the offload pools of its ranks; the CPU, the
    available memory shared by the node's ranks."""
    import torch

    from packtrain.distributed import agree

    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    cuda = info.device.type == "cuda"
    total = torch.cuda.get_device_properties(info.device).total_memory if cuda else None
    available = available_host_memory()
    unknown = -1  # agreed as a maximum of negatives: the smallest figure; any rank's unknown stays unknown
    known = [-(total if total is not None else unknown), -(available if available is not None else unknown)]
    total_min, available_min = (-v for v in agree(known, info))
    total = None if total_min < 0 or total is None else total_min
    available = None if available_min < 0 or available is None else available_min
    if cuda:
        host, source = _host_limit(None, cfg, available, "the node's available memory")
        reserve = device_reserve(total)
        return Budget("cuda", total - reserve, total, reserve, torch.cuda.get_device_name(info.device), host,
                      source, ranks)
    return _cpu_budget(available, ranks, "the host's available memory", None, "the host is the device")


def _cpu_budget(available: int | None, ranks: int, source: str, host: int | None, host_source: str) -> Budget:
    """On the CPU the step's memory is the host's: its available memory, less the reserve, shared by the node's
    ranks (the estimate counts CUDA's kernels; the CPU reference keeps somewhat more)."""
    if available is None:
        return Budget("cpu", None, None, 0, source, host, host_source, ranks)
    reserve = device_reserve(available)
    return Budget("cpu", max(0, available - reserve) // ranks, available, reserve, source, host, host_source, ranks)


def node_pool(per_rank_host: int, ranks_per_node: int, host_per_node: int | None) -> dict:
    """The offload pools of one node's ranks together (each rank's offloaded layer inputs, in whole chunks) and
    whether they fit the node's ``host_per_node`` bytes (None: not known)."""
    need = per_rank_host * ranks_per_node
    return {"ranks_per_node": ranks_per_node, "host_per_rank_bytes": per_rank_host, "host_per_node_bytes": need,
            "host_memory_per_node_bytes": host_per_node, "fits": None if host_per_node is None else need <= host_per_node}


def format_node_pool(pool: dict) -> str:
    n, per, need = pool["ranks_per_node"], pool["host_per_rank_bytes"] / GiB, pool["host_per_node_bytes"] / GiB
    line = f"offload pool per node: {n} rank{'s' * (n != 1)} x {per:.2f} GiB = {need:.2f} GiB of host memory"
    if pool["host_memory_per_node_bytes"] is None:
        return line + " (--host-memory-per-node GIB: whether it fits)"
    have = pool["host_memory_per_node_bytes"] / GiB
    if pool["fits"]:
        return line + f", fits {have:.2f} GiB ({have - need:.2f} GiB left)"
    return line + f", does not fit {have:.2f} GiB: {need - have:.2f} GiB short"
