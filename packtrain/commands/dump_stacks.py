"""`packtrain dump-stacks CONFIG [--pid PID ...]`: stacks of a running job's processes on this host, by hand.

Every training process lists itself in ``OUTPUT/ops/rank-N.json`` (pid, host) and registers faulthandler on
SIGUSR1, writing to ``OUTPUT/hang/rank-N.txt``. For each rank process on this host (or only ``--pid``), this
appends a header, then native + Python stacks from ``py-spy dump --native`` where py-spy is installed, else sends
SIGUSR1 (Python stacks of every thread, written by the process itself, even while it waits in C code), and finally
the ``nvidia-smi`` status. Run it on every node (e.g. ``srun --overlap`` or ``pdsh``) for a whole job.

``dump-stacks --pid PID`` without CONFIG: py-spy on any process, printed here. A process that does not catch
SIGUSR1 is never signalled (the default action of SIGUSR1 ends the process); /proc/PID/status says whether it does.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from packtrain.config import load_config
from packtrain.ops.runtime import DUMP_SIGNAL
from packtrain.ops.watchdog import dump_header, gpu_status, native_stacks


def catches_signal(pid: int, sig: int) -> bool:
    """From /proc/PID/status: is ``sig`` in the process's caught-signal mask (SigCgt)?"""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def registered_ranks(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out_dir / "ops").glob("rank-*.json"))]


def dump_one(entry: dict, wait: float = 5.0) -> str:
    """Append one dump for a registered rank process to its stacks file; returns how it was taken."""
    pid, path = entry["pid"], Path(entry["stacks"])
    with path.open("a") as f:
        f.write(dump_header(entry["rank"], pid, "packtrain dump-stacks"))
    native = native_stacks(pid)
    if not native.startswith(("py-spy not installed", "py-spy dump")):
        with path.open("a") as f:
            f.write("--- py-spy (native + Python) ---\n" + native)
        how = "py-spy"
    elif catches_signal(pid, DUMP_SIGNAL):
        size = path.stat().st_size
        os.kill(pid, DUMP_SIGNAL)
        deadline = time.monotonic() + wait
        while path.stat().st_size == size and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # let faulthandler finish the other threads
        with path.open("a") as f:
            f.write(f"(the Python stacks above came from SIGUSR1; {native})\n")
        how = "SIGUSR1 (faulthandler)"
    else:
        raise ValueError(f"rank {entry['rank']} (pid {pid}) does not catch SIGUSR1 and py-spy is not usable: {native}")
    with path.open("a") as f:
        f.write("--- GPU ---\n" + gpu_status(entry.get("local_rank")) + "\n")
    return how


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def run_dump_stacks(args) -> int:
    if args.config is None:
        if not args.pid:
            raise ValueError("give CONFIG (the running job's config) or --pid PID")
        for pid in args.pid:
            print(dump_header(None, pid, "packtrain dump-stacks") + native_stacks(pid))
        return 0
    cfg = load_config(args.config, args.overrides)
    out = cfg.output_path
    host = socket.gethostname()
    entries = [e for e in registered_ranks(out) if e["host"] == host and _alive(e["pid"])
               and (not args.pid or e["pid"] in args.pid)]
    if not entries:
        raise ValueError(f"no running rank of {out} on {host} (ranks list themselves in {out / 'ops'} while they "
                         "train)")
    for entry in entries:
        how = dump_one(entry)
        print(f"rank {entry['rank']} (pid {entry['pid']}): {how} -> {entry['stacks']}")
    return 0
