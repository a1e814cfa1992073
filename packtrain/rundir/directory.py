"""One run per output directory: the lock, what a new run may find there, temporaries, and checkpoint retention.

- ``OUTPUT/packtrain.lock`` (JSON: pid, host, start time) is created exclusively by rank 0 and removed when the run
  ends. A lock whose process is gone from this host (a SIGKILL, a hang abort) is taken over, and the log says so;
  a live holder, or one on another host, refuses the run naming it. Deciding and taking over happen under an
  ``flock`` of OUTPUT itself: of two restarts that find the same dead holder at once, exactly one takes over and
  the other is refused naming it.
- A directory holding a previous run's ``adapter/``, ``checkpoints/step-N`` or ``metrics.jsonl`` is refused unless
  ``--resume`` (continue it) or ``--overwrite`` (remove :data:`OUTPUTS` first, listed in the log).
- A run directory carries :data:`MARKER`, written by the first run in it, listing what packtrain writes there. A
  non-empty directory without it is not packtrain's and is refused, ``--overwrite`` included (packtrain would write
  its ``config.yaml`` and remove its ``base/``, ``ops/`` and ``adapter/``). ``--overwrite`` removes only what the
  marker lists.
- Leftover temporaries of interrupted writes (``.tmp-*``, ``.old-*``) are removed once the lock is held.
- After each successful save, checkpoints beyond the newest ``train.keep_checkpoints`` are removed.

Rank 0 decides; every rank gets the verdict by one broadcast, so a refusal ends every rank with the same message
instead of leaving the others waiting in the next collective.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import torch.distributed as dist

from packtrain.distributed import DistInfo
from packtrain.rundir.checkpoint import checkpoints

LOCK = "packtrain.lock"
NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}  # flock refused by the filesystem
# What `--overwrite` removes: everything `train` writes into OUTPUT (nothing else there is touched).
OUTPUTS = ("adapter", "checkpoints", "metrics.jsonl", "loss.png", "config.yaml", "base", "tokenizer", "hang", "ops",
           "generations", "wandb-run-id", "reference.json", "overrides.json", "rollouts")


# Folders of OUTPUTS that a user may put files of their own in: --overwrite removes only the files packtrain writes
# there (generations/step-N.jsonl and step-N.errors.md, and their .tmp while written: packtrain.run.task)
OWN_FILES_ONLY = {"generations": re.compile(r"step-\d+\.(jsonl|errors\.md)(\.tmp)?"),
                  "rollouts": re.compile(r"step-\d+\.jsonl(\.tmp)?")}  # online grpo's (packtrain.run.rollouts)


MARKER = "packtrain-run.json"
# packtrain's own entries a directory may hold before a run marks it: the lock, temporaries of interrupted writes,
# check_writable's probe, and the folders `smoke` and `pretune-fla` write under OUTPUT by default
OWN = (LOCK, "smoke", "fla-configs")
OWN_PREFIXES = (".tmp-", ".old-", ".write-probe-")


class RunDirError(ValueError):
    pass


def foreign_entries(out: Path) -> list[str]:
    """What makes ``out`` a directory packtrain may not take: its entries, when it has no :data:`MARKER` (nothing
    for a missing or empty directory, or one holding only packtrain's own :data:`OWN` entries)."""
    marker = out / MARKER
    if marker.is_symlink() and not marker.exists():  # else "no packtrain-run.json; it holds packtrain-run.json"
        raise RunDirError(f"{marker} is a symbolic link to {os.readlink(marker)}, which does not exist: the run "
                          f"marker must be a file; if this is a packtrain run directory, replace the link with a copy "
                          f"of the marker (or write {{}} to {marker})")
    if not out.is_dir() or marker.exists():
        return []
    return sorted(p.name + "/" * p.is_dir() for p in out.iterdir()
                  if p.name not in OWN and not p.name.startswith(OWN_PREFIXES))


def check_not_foreign(out: Path) -> None:
    found = foreign_entries(out)
    if found:
        shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        raise RunDirError(f"{out} is not empty and holds no packtrain run (no {MARKER}; it holds {shown}): choose "
                          f"an empty or new output_dir (a run directory of a packtrain from before the marker: "
                          f"write {{}} to {out / MARKER})")


def manifest(out: Path) -> tuple[str, ...]:
    """What :data:`MARKER` says packtrain writes in ``out`` (a marker without the list, written by hand: all of
    :data:`OUTPUTS`); never a name outside OUTPUTS."""
    try:
        raw = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        raise RunDirError(f"{out / MARKER}: unreadable run marker; if this is a packtrain run directory, write {{}} "
                          "to it") from None
    wrote = raw.get("wrote") if isinstance(raw, dict) else None
    if not isinstance(wrote, list):
        return OUTPUTS
    return tuple(name for name in OUTPUTS if name in wrote)


def _mark(out: Path) -> None:
    if not (out / MARKER).exists():
        (out / MARKER).write_text(json.dumps({"run directory of": "packtrain train", "wrote": list(OUTPUTS),
                                              "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
                                  + "\n")


def previous_outputs(out: Path) -> list[str]:
    """A previous run's results in ``out``: what a new run would replace."""
    found = []
    if (out / "adapter").exists():
        found.append("adapter/")
    n = len(checkpoints(out))
    if n:
        found.append(f"checkpoints/ ({n} checkpoint{'s' if n > 1 else ''})")
    if (out / "metrics.jsonl").exists():
        found.append("metrics.jsonl")
    return found


def _policy(out: Path, resume: bool, overwrite: bool, log) -> None:
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: choose one")
    found = previous_outputs(out)
    if not found or resume:
        return
    if not overwrite:
        raise RunDirError(f"{out} holds a previous run ({', '.join(found)}): continue it with --resume, start over "
                          "with --overwrite (removes it), or choose another output_dir")
    removed = [name for name in manifest(out) if (out / name).exists()]
    log(f"--overwrite: removing {', '.join(n + '/' * (out / n).is_dir() for n in removed)} from {out}")
    for name in removed:
        path = out / name
        if name in OWN_FILES_ONLY and path.is_dir() and not path.is_symlink():
            _remove_own_files(path, OWN_FILES_ONLY[name], log)
        else:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _remove_own_files(folder: Path, pattern: re.Pattern, log) -> None:
    """The files of ``folder`` that packtrain writes (names matching ``pattern``); anything else there stays, said
    once, and so does the folder that holds it."""
    kept = []
    for path in sorted(folder.iterdir()):
        if pattern.fullmatch(path.name) and path.is_file() and not path.is_symlink():
            path.unlink()
        else:
            kept.append(path.name)
    if kept:
        log(f"--overwrite: kept {', '.join(kept)} in {folder} (not written by packtrain)")
    else:
        folder.rmdir()


def clean_temporaries(out: Path, log) -> None:
    """Half-written directories and files of a run that died mid-write (never a complete ``step-N``)."""
    for folder in (out, out / "checkpoints"):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if path.name.startswith((".tmp-", ".old-")):
                log(f"removing {path} (left by an interrupted write)")
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def prune_checkpoints(out: Path, keep: int | None, log) -> None:
    if keep is None:
        return
    for old in checkpoints(out)[keep:]:
        shutil.rmtree(old)


# -- the lock ---------------------------------------------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start in clock ticks since boot) of a process from /proc/PID/stat, None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> float | None:
    """Start time (epoch seconds) of a live process from /proc, None where unknown; -1.0 for a zombie. Through the
    wall clock (btime): for locks' readers that knew nothing else (``process_ticks`` is exact)."""
    stat = _proc_stat(pid)
    try:
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    if stat is None:
        return None
    if stat[0] == "Z":
        return -1.0
    return boot + stat[1] / os.sysconf("SC_CLK_TCK")


def holder_alive(holder: dict) -> bool:
    """Whether the lock's process may still run: certain only on this host."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return not isinstance(pid, int)
    written = holder.get("started")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = _proc_stat(pid)
    if stat is not None and stat[0] in ("Z", "X"):
        return False  # a zombie: it has exited
    ticks, boot = holder.get("process_ticks"), holder.get("boot_id")
    if stat is not None and isinstance(ticks, int) and isinstance(boot, str) and boot == _boot_id():
        # the holder's own start in clock ticks since this boot, as it read it: a reused pid has another one. No
        # wall clock on either side: btime moves when a VM's clock is stepped, and a step between the holder's
        # write and this read made a live holder look reused (1 of 300 concurrent trials, twice)
        return stat[1] == ticks
    if isinstance(boot, str) and _boot_id() not in (None, boot):
        return False  # written before this machine last booted: its process is gone
    started = _process_start(pid)
    if started is None:
        return True
    recorded = holder.get("process_start")
    if isinstance(recorded, (int, float)):
        # a lock of an older packtrain: its holder's start through the wall clock, read the same way
        return abs(started - float(recorded)) < 1.0
    # an older lock: a reused pid started after the lock was written (a lock without its start time cannot show
    # that: a live pid holds it)
    if not isinstance(written, (int, float)):
        return True
    return not started > float(written) + 2.0


@contextlib.contextmanager
def _deciding(out: Path, log):
    """An exclusive ``flock`` of the directory ``out`` while a process looks at the lock file and takes it: only one
    decides at a time. (The lock file itself cannot carry it: a takeover replaces that file, and a second process
    would lock the new one.) A process that dies releases it."""
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in NO_FLOCK:
                raise
            # a filesystem without flock (Lustre mounted without -o flock, some FUSE): the exclusive create still
            # refuses a live holder; only two takeovers of one dead holder at the same moment could both succeed
            log(f"{out}: this filesystem has no flock ({e.strerror}); taking the lock without it")
        yield
    finally:
        os.close(fd)


class RunLock:
    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def acquire(cls, out: Path, log) -> RunLock:
        path = out / LOCK
        stat = _proc_stat(os.getpid())
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "process_start": _process_start(os.getpid()), "process_ticks": stat[1] if stat else None,
              "boot_id": _boot_id(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with _deciding(out, log):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                cls._take_over_if_stale(path, log)  # refuses a live holder
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return cls(path)

    @staticmethod
    def _take_over_if_stale(path: Path, log) -> None:
        try:
            text = path.read_text()
            if not text.strip():  # its writer holds the flock while writing: one that left it empty has died
                log(f"taking over the empty lock {path}: its writer died before writing it")
                path.unlink(missing_ok=True)
                return
            holder = json.loads(text)
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            raise RunDirError(f"{path}: unreadable lock file; if no run uses this directory, delete it") from None
        who = (f"pid {holder.get('pid')} on {holder.get('host')} (started {holder.get('started_utc', '?')})"
               if isinstance(holder, dict) else "?")
        if not isinstance(holder, dict) or holder_alive(holder):
            other_host = isinstance(holder, dict) and holder.get("host") != socket.gethostname()
            hint = (" packtrain cannot see processes on another host: if that run is gone, delete the lock file"
                    if other_host else "")
            raise RunDirError(f"{path.parent} is in use by another run: {who} holds {path}.{hint}")
        log(f"taking over the stale lock {path}: {who} is no longer running")
        path.unlink(missing_ok=True)

    def release(self) -> None:
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass


def claim(out: Path, resume: bool, overwrite: bool, info: DistInfo, log) -> RunLock | None:
    """Rank 0 takes the lock and applies the policy; every rank gets the verdict (one broadcast). Returns the lock
    on rank 0, None elsewhere; raises :class:`RunDirError` on every rank when refused."""
    lock, refusal = None, None
    if info.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            check_not_foreign(out)  # before the lock: nothing is written into a directory that is not ours
            lock = RunLock.acquire(out, log)
            check_not_foreign(out)
            _policy(out, resume, overwrite, log)
            _mark(out)
            clean_temporaries(out, log)
        except (RunDirError, OSError) as e:
            refusal = str(e)
            if lock is not None:
                lock.release()
    if info.enabled:
        verdict = [refusal]
        dist.broadcast_object_list(verdict, src=0)
        refusal = verdict[0]
    if refusal is not None:
        raise RunDirError(refusal if info.is_main else f"rank 0 refused {out}: {refusal}")
    return lock
