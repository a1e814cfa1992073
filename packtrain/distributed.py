"""Rank, world size and device from the launcher's environment (torchrun and ``accelerate launch`` set the
same variables), and the few collectives the trainer needs. One process without a launcher is rank 0 of 1."""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# Imported before any process group exists: its collectives take ``group=group.WORLD`` as a default argument,
# so importing it later (peft does) pins the default group in those defaults for good, destroy_process_group
# cannot free it, and gloo's worker threads live on into interpreter shutdown (see shutdown()).
import torch.distributed.nn

from packtrain import versions
from packtrain.exits import Stalled

# What gloo and NCCL say when the other end of a collective went away (its process killed, its machine lost)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
             "NCCL communicator was aborted", "remote process exited")
# every rank's (rank, machine, host, pid), gathered once the group is up: who a failed collective was waiting for
_peers: list[tuple[int, int, str, int]] = []
PEER_EXIT_WAIT = 5.0  # seconds a lost peer of this host may take to finish exiting


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


def init_distributed(device_pref: str = "auto", timeout_s: float | None = None,
                     refuse_versions: bool = True) -> DistInfo:
    """``timeout_s`` (``ops.collective_timeout``): how long the rendezvous and each collective may wait. Under a
    launcher every rank's dependency versions are gathered with the peers, and a version outside the tested ranges
    on any rank is refused on every rank, unless ``refuse_versions`` is False (``check-nodes``: it shows them in its
    table and refuses after it)."""
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
        mine = (rank, int(os.environ.get("GROUP_RANK", "0") or 0), socket.gethostname(), os.getpid())
        gathered: list = [None] * world
        # with the peers, each rank's dependency versions outside the tested ranges: refused on every rank alike
        # (a rank that refused alone would leave the others waiting at their first collective)
        dist.all_gather_object(gathered, (mine, versions.findings(versions.found_versions())))
        _peers[:] = [peer for peer, _ in gathered]
        if refuse_versions:
            _agree_on_versions([(peer[0], lines) for peer, lines in gathered])
    return DistInfo(rank, world, local_rank, device)


def _agree_on_versions(findings: list[tuple[int, list[str]]]) -> None:
    """Refuse on every rank when any rank imports a version outside the tested ranges (what the single-process
    check in ``packtrain.cli`` refuses), naming the ranks of each finding."""
    by_line: dict[str, list[int]] = {}
    for rank, lines in findings:
        for line in lines:
            by_line.setdefault(line, []).append(rank)
    if not by_line:
        return
    lines = [f"{line} (rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))})"
             for line, ranks in by_line.items()]
    try:
        versions.check_versions_of(lines)
    except versions.UntestedVersionError:
        shutdown()
        raise


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (gone, or a zombie not yet reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def lost_peer(e: BaseException) -> str | None:
    """"rank N on machine M stopped answering ..." when ``e`` is a collective failing because a peer went away, else
    None. Ranks of this host are looked up by pid; a peer elsewhere is named by the address gloo gives."""
    text = str(e)
    if not isinstance(e, RuntimeError) or not _peers or not any(t in text for t in PEER_GONE):
        return None
    host = socket.gethostname()
    here = [(r, m, pid) for r, m, h, pid in _peers if h == host and pid != os.getpid()]
    deadline = time.monotonic() + (PEER_EXIT_WAIT if here else 0)
    # the connection closes while the killed process is still exiting: give it a moment to show as gone
    while not (gone := [(r, m, pid) for r, m, pid in here if process_gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    if gone:
        return "; ".join(f"rank {r} on machine {m} stopped answering (pid {pid} on this host is gone)"
                         for r, m, pid in gone)
    where = text.split(" by peer ", 1)[1].split()[0].rstrip(".") if " by peer " in text else "another host"
    machines = sorted({m for r, m, h, _ in _peers if h != host})
    on = f" on machine {', '.join(map(str, machines))}" if len(machines) == 1 else ""
    return f"a rank{on} stopped answering (its connection at {where} closed)"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


# What accelerate launch passes on from its config file that :func:`apply_launcher_settings` reads: they change the
# config, so every machine must be started with the same (packtrain.ops.nodes compares them)
LAUNCHER_VARIABLES = ("ACCELERATE_MIXED_PRECISION", "FSDP_ACTIVATION_CHECKPOINTING", "FSDP_SHARDING_STRATEGY",
                      "FSDP_OFFLOAD_PARAMS")


def apply_launcher_settings(cfg, environ=os.environ, log=print) -> list[str]:
    """What ``accelerate launch`` passes on from its config file (as environment variables) and packtrain has an
    equivalent for, applied to ``cfg``; what would conflict is a :class:`ValueError` naming the packtrain key.
    Returns one note per setting applied (rank 0 logs them). Why: an accelerate config with ``distributed_type: FSDP``,
    ``fsdp_activation_checkpointing`` or ``mixed_precision: bf16`` trained as if absent. packtrain shards with FSDP2
    itself, never autocasts, and reads only these (docs/distributed.md):

    - ``ACCELERATE_MIXED_PRECISION`` (``mixed_precision``): ``bf16`` is ``model.dtype: bfloat16`` (a float32
      ``model.dtype`` is set to it; any other is refused), ``fp16`` / ``fp8`` are refused, ``no`` is nothing;
    - ``FSDP_ACTIVATION_CHECKPOINTING``: true is ``train.activation_checkpointing: true``;
    - ``FSDP_SHARDING_STRATEGY`` other than full sharding, and ``FSDP_OFFLOAD_PARAMS``, are refused (packtrain shards
      every layer fully; ``train.offload`` keeps layer inputs, not parameters, in host memory).
    """
    notes = []
    precision = (environ.get("ACCELERATE_MIXED_PRECISION") or "no").strip().lower()
    if precision == "bf16":
        if cfg.model.dtype == "float32":
            cfg.model.dtype = "bfloat16"
            notes.append("model.dtype: bfloat16, from accelerate's mixed_precision: bf16 (ACCELERATE_MIXED_PRECISION; "
                         "packtrain keeps the weights in bf16 instead of autocasting)")
        elif cfg.model.dtype != "bfloat16":
            raise ValueError(f"model.dtype: {cfg.model.dtype} conflicts with accelerate's mixed_precision: bf16 "
                             "(ACCELERATE_MIXED_PRECISION=bf16): packtrain never autocasts; set model.dtype: bfloat16, "
                             "or mixed_precision: 'no' in the accelerate config")
    elif precision not in ("no", ""):
        raise ValueError(f"model.dtype: accelerate's mixed_precision: {precision} (ACCELERATE_MIXED_PRECISION) has no "
                         "packtrain equivalent (model.dtype takes float32, bfloat16 or float64; packtrain never "
                         "autocasts); set mixed_precision: 'no' in the accelerate config")
    if _truthy(environ.get("FSDP_ACTIVATION_CHECKPOINTING")) and cfg.train.activation_checkpointing is not True:
        # accelerate's setting is the user's: it is given, as a value in the config is (auto would choose)
        cfg.train.activation_checkpointing = True
        notes.append("train.activation_checkpointing: true, from accelerate's fsdp_activation_checkpointing "
                     "(FSDP_ACTIVATION_CHECKPOINTING)")
    strategy = (environ.get("FSDP_SHARDING_STRATEGY") or "FULL_SHARD").strip().upper()
    if strategy not in ("FULL_SHARD", "1"):
        raise ValueError(f"train: accelerate's fsdp_sharding_strategy {strategy} (FSDP_SHARDING_STRATEGY) has no "
                         "packtrain equivalent: packtrain shards every layer fully with FSDP2 itself; remove it "
                         "from the accelerate config")
    if _truthy(environ.get("FSDP_OFFLOAD_PARAMS")):
        raise ValueError("train.offload: accelerate's fsdp_offload_params (FSDP_OFFLOAD_PARAMS) keeps parameters in "
                         "host memory, which packtrain does not do; train.offload keeps layer inputs there instead: "
                         "remove fsdp_offload_params from the accelerate config")
    if environ.get("RANK", "0") == "0":
        for note in notes:
            log(note)
    return notes


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


def agree(values, info: DistInfo) -> list[int]:
    """Each value's maximum over the ranks (``values`` as is on one rank): one all-reduce, for every decision the ranks
    make together (the equal-call rule, packtrain/packed/equal.py)."""
    t = torch.tensor(list(values) or [0], dtype=torch.int64, device=info.device)
    return all_reduce_max_tensor(t, info).tolist()[:len(values)]
