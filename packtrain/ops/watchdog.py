"""Hang evidence: every rank's Python and native stacks, and what its GPU is doing.

Why: under FSDP a rank that takes a different path leaves the others waiting inside a collective, with no error
and no traceback. Two signs find such a hang: ``nvidia-smi`` showing 100% utilisation at low board power (~120 W
instead of 600-700 W of real work on an H100: the NCCL kernel spins while it waits), and py-spy stacks from every
rank.

- :class:`HangWatchdog`: a thread per training process; when no step completes within ``ops.hang_timeout``
  seconds it appends one dump to ``OUTPUT/hang/rank-N.txt`` (once per silence; a later step re-arms it). Every
  rank runs its own, so a collective hang leaves one file per rank with no coordination. With ``abort_after``
  (``ops.hang_abort``), a silence that lasts that much longer after the dump calls ``abort`` (the trainer exits
  124): a rank waiting forever in a collective for a stopped peer ends, and the launcher ends the rest.
- A dump: Python stacks of every thread (``sys._current_frames``), native stacks from ``py-spy dump --native``
  where py-spy is installed (it needs ptrace permission: CAP_SYS_PTRACE or ``kernel.yama.ptrace_scope=0``), and
  ``nvidia-smi`` utilisation and board power where it exists.
- By hand (``packtrain dump-stacks``): training processes register faulthandler on SIGUSR1, writing to the same
  file; ``dump-stacks`` signals them (or runs py-spy on them), see :mod:`packtrain.commands.dump_stacks`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

COLLECTIVE_HINT = ("100% utilisation at low board power (e.g. ~120 W of 700 W) is a rank waiting inside a "
                   "collective for a rank that never joined it")


def python_stacks(skip_current: bool = True) -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if skip_current and ident == threading.get_ident():
            continue
        parts.append(f"Thread {names.get(ident, '?')} ({ident}), most recent call last:\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def native_stacks(pid: int, timeout: float = 60.0) -> str:
    """``py-spy dump --native`` of ``pid``, or a line saying why there are none."""
    exe = shutil.which("py-spy")
    if exe is None:
        return "py-spy not installed: no native frames (pip install py-spy)"
    try:
        proc = subprocess.run([exe, "dump", "--pid", str(pid), "--native"], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"py-spy dump --pid {pid} timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        return f"py-spy dump --pid {pid} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}"
    return proc.stdout


def gpu_status(local_rank: int | None = None) -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi: not found (no GPU status)"
    query = "index,name,utilization.gpu,power.draw,power.limit,memory.used,memory.total"
    try:
        proc = subprocess.run([exe, f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True,
                              timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return "nvidia-smi timed out after 30 s"
    mine = f" (this rank: local rank {local_rank})" if local_rank is not None else ""
    return f"nvidia-smi{mine}; {COLLECTIVE_HINT}\n{proc.stdout or proc.stderr}"


def dump_header(rank: int | None, pid: int, reason: str) -> str:
    who = f"rank {rank}, " if rank is not None else ""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"\n===== {stamp} {who}pid {pid} on {socket.gethostname()}: {reason} =====\n"


def write_dump(path: Path, reason: str, rank: int | None = None, local_rank: int | None = None,
               native: bool = True) -> Path:
    """Append this process's stacks (and GPU status) to ``path``; called from a thread other than the stuck one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = [dump_header(rank, os.getpid(), reason), "--- Python stacks ---", python_stacks()]
    if native:
        text += ["--- native stacks ---", native_stacks(os.getpid())]
    text += ["--- GPU ---", gpu_status(local_rank), ""]
    with path.open("a") as f:
        f.write("\n".join(text))
    return path


class HangWatchdog:
    """Calls ``dump(reason)`` once when ``beat()`` has not been called for ``timeout`` seconds."""

    def __init__(self, timeout: float, dump: Callable[[str], Path], log=print, clock=time.monotonic,
                 abort_after: float | None = None, abort: Callable[[str], None] | None = None):
        self.timeout = timeout
        self.abort_after = abort_after
        self.abort = abort
        self.dump = dump
        self.log = log
        self.clock = clock
        self._last = clock()
        self._label = "start"
        self._fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="packtrain-hang-watchdog", daemon=True)

    def start(self) -> None:
        self._last = self.clock()
        self._thread.start()

    def beat(self, label: str) -> None:
        self._last, self._label, self._fired = self.clock(), label, False

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        poll = min(self.timeout / 4, (self.abort_after or self.timeout) / 4, 30.0)
        while not self._stop.wait(poll):
            silent = self.clock() - self._last
            if (self._fired and self.abort is not None and self.abort_after is not None
                    and silent >= self.timeout + self.abort_after):
                self.abort(f"no progress for {silent:.0f} s (ops.hang_timeout={self.timeout:g} + "
                           f"ops.hang_abort={self.abort_after:g}); last completed: {self._label}")
                return
            if silent >= self.timeout and not self._fired:
                self._fired = True
                reason = (f"no step completed for {silent:.0f} s (ops.hang_timeout={self.timeout:g}); "
                          f"last completed: {self._label}")
                path = self.dump(reason)
                self.log(f"packtrain: {reason}; stacks in {path}")
