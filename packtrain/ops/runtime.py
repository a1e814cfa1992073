"""The hooks one training process calls: ``start`` before step 0, ``step_done`` / ``eval_done`` after each
record is written to metrics.jsonl, ``close`` at the end (also after an error).

``start``: check-nodes over all ranks (unless ``ops.check_nodes: false``; a difference raises
:class:`NodeMismatchError` on every rank; one process only gets the FLA pinning note), the rank's entry in
``OUTPUT/ops/rank-N.json`` (pid and host, for ``packtrain dump-stacks``), faulthandler on SIGUSR1 into
``OUTPUT/hang/rank-N.txt``, the hang watchdog (unless ``ops.hang_timeout`` is null) and, on rank 0, the wandb
mirror. The watchdog's first interval covers model setup and the first step too.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from packtrain.distributed import process_gone
from packtrain.exits import STALLED_EXIT
from packtrain.ops import nodes
from packtrain.ops.wandb_mirror import WandbMirror, require_wandb
from packtrain.ops.watchdog import HangWatchdog, write_dump

DUMP_SIGNAL = signal.SIGUSR1


def rank_file(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / "ops" / f"rank-{rank}.json"


def stacks_file(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / "hang" / f"rank-{rank}.txt"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class RunOps:
    def __init__(self, cfg, dist_info, out_dir: Path, log=print):
        self.cfg = cfg
        self.info = dist_info
        self.out = Path(out_dir)
        self.log = log
        self.watchdog: HangWatchdog | None = None
        self.wandb = None
        self._signal_file = None

    def start(self) -> None:
        wandb_mode = self.cfg.logging.wandb
        if wandb_mode != "off":
            require_wandb(wandb_mode)
        if self.cfg.ops.check_nodes:
            # one process has nothing to compare: no table, only the FLA note below
            reports = (nodes.check_nodes(self.info, self.log, self.cfg) if self.info.enabled
                       else [nodes.node_report(self.info.rank, self.info.device)])
            fla_possible = self.cfg.model.kernels != "torch" and self.info.device.type == "cuda"
            note = nodes.fla_pinning_note(reports[0].fields) if fla_possible else None
            if note and self.info.is_main:
                self.log(note)
        self._register()
        if self.cfg.ops.hang_timeout is not None:
            self.watchdog = HangWatchdog(self.cfg.ops.hang_timeout, self._dump, log=_stderr,
                                         abort_after=self.cfg.ops.hang_abort, abort=self._abort)
            self.watchdog.start()
        if self.info.is_main and wandb_mode != "off":
            self.wandb = WandbMirror(wandb_mode, self.cfg.logging.wandb_project, self.out,
                                     self.cfg.to_dict())

    def progress(self, label: str) -> None:
        """Setup milestones, evaluation units and saves: progress the watchdog must see."""
        if self.watchdog is not None:
            self.watchdog.beat(label)

    def step_done(self, record: dict) -> None:
        self._done(record, f"step {record['step']}")

    def eval_done(self, record: dict) -> None:
        what = "generation" if record.get("split") == "generate" else "eval"
        self._done(record, f"{what} at step {record['step']}")

    def _done(self, record: dict, label: str) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(label)
        if self.wandb is not None:
            self.wandb.log(record)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
        if self._signal_file is not None:
            faulthandler.unregister(DUMP_SIGNAL)
            self._signal_file.close()
            self._signal_file = None
            rank_file(self.out, self.info.rank).unlink(missing_ok=True)
            stacks = stacks_file(self.out, self.info.rank)
            if stacks.exists() and stacks.stat().st_size == 0:  # no dump was taken: leave no empty evidence
                stacks.unlink()
            self._forget_gone_ranks()
            for folder in (stacks.parent, rank_file(self.out, 0).parent):
                try:
                    folder.rmdir()
                except OSError:  # not empty: a dump, or another rank still running
                    pass

    def _forget_gone_ranks(self) -> None:
        """The entries of this host's ranks that died without closing (SIGKILL, a lost machine's peers): their
        ``ops/rank-N.json`` and, when no dump was taken, their empty stacks file."""
        host = socket.gethostname()
        try:
            entries = list(rank_file(self.out, 0).parent.glob("rank-*.json"))
        except OSError:  # the folder removed meanwhile by the last rank to close
            return
        for entry in entries:
            try:
                rec = json.loads(entry.read_text())
                rank, pid = int(rec["rank"]), int(rec["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if rec.get("host") != host or pid == os.getpid() or not process_gone(pid):
                continue
            stacks = stacks_file(self.out, rank)
            try:  # another survivor may be removing the same entries
                if stacks.stat().st_size == 0:
                    stacks.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            entry.unlink(missing_ok=True)

    def _register(self) -> None:
        rank = self.info.rank
        stacks = stacks_file(self.out, rank)
        stacks.parent.mkdir(parents=True, exist_ok=True)
        self._signal_file = stacks.open("a")
        faulthandler.register(DUMP_SIGNAL, file=self._signal_file, all_threads=True, chain=False)
        entry = rank_file(self.out, rank)
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.write_text(json.dumps({"rank": rank, "local_rank": self.info.local_rank, "pid": os.getpid(),
                                     "host": socket.gethostname(), "stacks": str(stacks.resolve()),
                                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")

    def _abort(self, reason: str) -> None:
        # From the watchdog thread while the main thread is stuck: no cleanup can run, so end the process now.
        _stderr(f"packtrain: rank {self.info.rank} stalled: {reason}; aborting (exit {STALLED_EXIT}); "
                f"stacks in {stacks_file(self.out, self.info.rank)}; restart with --resume")
        os._exit(STALLED_EXIT)

    def _dump(self, reason: str) -> Path:
        return write_dump(stacks_file(self.out, self.info.rank), reason, self.info.rank, self.info.local_rank)
