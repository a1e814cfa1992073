"""RunOps driven as the trainer drives it: check-nodes at start, a heartbeat per record, wandb mirroring
metrics.jsonl, stack dumps on a hang, on SIGUSR1 and from `packtrain dump-stacks`."""

import json
import os
import signal
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from cli_helpers import run_in_process, start_ranks
from long_run_helpers import wait_for

from packtrain.config import config_from_dict
from packtrain.distributed import DistInfo
from packtrain.ops.runtime import RunOps, rank_file, stacks_file
from packtrain.run.metrics import MetricsLog

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _cfg(tmp_path, **ops):
    return config_from_dict({"output_dir": str(tmp_path / "run"), "ops": {"check_nodes": False, **ops},
                             "logging": {"wandb": "off"}})


def sleeping_step(seconds):
    time.sleep(seconds)


class FakeWandb(types.ModuleType):
    """Enough of wandb for the mirror: init(...) -> a run with log(values, step) and finish()."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0
        self.util = types.SimpleNamespace(generate_id=lambda: "run-0001")

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda values, step: self.logged.append((step, values)),
                                     finish=lambda: setattr(self, "finished", self.finished + 1))


def drive_like_the_trainer(ops, out: Path, steps: int, slow_step: int | None = None, slow_seconds: float = 0.0):
    """The calls trainer.py makes: start before step 0, eval_done / step_done after each metrics line, close."""
    metrics = MetricsLog(out / "metrics.jsonl")
    ops.start()
    try:
        record = {"split": "eval", "step": 0, "loss": 2.5, "examples": 4}
        metrics.write(record)
        ops.eval_done(record)
        for step in range(1, steps + 1):
            if step == slow_step:
                sleeping_step(slow_seconds)
            record = {"step": step, "epoch": 0, "loss": 2.0 / step, "lr": 1e-3, "grad_norm": 0.5, "examples": 4,
                      "packs": 2, "positions": 100, "seconds": 0.01, "peak_memory_bytes": 123}
            metrics.write(record)
            ops.step_done(record)
        record = {"split": "generate", "step": steps, "exact_match": 0.25, "mean_score": 0.5, "examples": 4}
        metrics.write(record)
        ops.eval_done(record)
    finally:
        ops.close()


def test_a_step_slower_than_the_timeout_leaves_a_stack_file_naming_it(tmp_path):
    cfg = _cfg(tmp_path, hang_timeout=0.3)
    out = Path(cfg.output_dir)
    drive_like_the_trainer(RunOps(cfg, ONE, out, log=lambda _: None), out, steps=3, slow_step=2, slow_seconds=1.2)
    text = stacks_file(out, 0).read_text()
    assert text.count("=====") == 2  # one dump for the one silence
    assert "no step completed for" in text and "last completed: step 1" in text
    assert "in sleeping_step" in text and "in drive_like_the_trainer" in text
    assert not rank_file(out, 0).exists()  # the process left: dump-stacks has nothing to signal


def test_a_clean_run_leaves_no_hang_files(tmp_path):
    cfg = _cfg(tmp_path, hang_timeout=5.0)
    out = Path(cfg.output_dir)
    drive_like_the_trainer(RunOps(cfg, ONE, out), out, steps=3)
    assert not (out / "hang").exists() and not (out / "ops").exists()


def test_wandb_mirrors_metrics_jsonl_and_resumes_the_same_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "ops": {"check_nodes": False},
                            "logging": {"wandb": "offline", "wandb_project": "proj"}})
    out = Path(cfg.output_dir)
    drive_like_the_trainer(RunOps(cfg, ONE, out), out, steps=2)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = []
    for rec in lines:
        prefix = {"eval": "eval", "generate": "generate"}.get(rec.get("split"), "train")
        expected.append((rec["step"], {f"{prefix}/{k}": v for k, v in rec.items() if k not in ("step", "split")}))
    assert fake.logged == expected
    assert fake.logged[-1] == (2, {"generate/exact_match": 0.25, "generate/mean_score": 0.5, "generate/examples": 4})
    assert fake.inits[0]["mode"] == "offline" and fake.inits[0]["project"] == "proj"
    assert fake.inits[0]["config"]["logging"]["wandb"] == "offline" and fake.finished == 1
    RunOps(cfg, ONE, out).start()
    assert fake.inits[1]["id"] == fake.inits[0]["id"] == "run-0001" and fake.inits[1]["resume"] == "allow"


def test_wandb_asked_for_but_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "logging": {"wandb": "online"}})
    with pytest.raises(ValueError, match=r"logging.wandb=online but the wandb package is not installed"):
        RunOps(cfg, ONE, Path(cfg.output_dir)).start()


def test_start_checks_nodes_only_across_ranks(tmp_path, monkeypatch):
    from packtrain.ops import nodes

    checked = []
    monkeypatch.setattr(nodes, "check_nodes", lambda info, log, cfg=None: checked.append(info.world_size) or [])
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "ops": {"hang_timeout": None}})
    two = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    for info, off in ((ONE, False), (two, True), (two, False)):
        cfg.ops.check_nodes = not off
        ops = RunOps(cfg, info, tmp_path / "run", log=lambda _: None)
        ops.start()
        ops.close()
    assert checked == [2]  # one process: nothing to compare; ops.check_nodes false: never


def test_sigusr1_writes_python_stacks_to_the_rank_file(tmp_path):
    cfg = _cfg(tmp_path, hang_timeout=None)
    out = Path(cfg.output_dir)
    ops = RunOps(cfg, ONE, out)
    ops.start()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        text = stacks_file(out, 0).read_text()
    finally:
        ops.close()
    assert "test_sigusr1_writes_python_stacks_to_the_rank_file" in text


_STUCK_RANK = """
import sys, time, torch
from pathlib import Path
from packtrain.config import load_config
from packtrain.distributed import DistInfo
from packtrain.ops.runtime import RunOps

def waiting_in_a_collective():
    time.sleep(60)

cfg = load_config(sys.argv[1])
RunOps(cfg, DistInfo(0, 1, 0, torch.device("cpu")), Path(cfg.output_dir)).start()
Path(sys.argv[2]).write_text("started")  # SIGUSR1 is caught from here on
waiting_in_a_collective()
"""


@pytest.mark.process
def test_dump_stacks_command_reaches_a_running_rank(tmp_path):
    """The rank is a process of its own (forked, stuck in a sleep); `packtrain dump-stacks` runs here."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"# packtrain train cfg.yaml\noutput_dir: {tmp_path / 'run'}\n"
                   "ops: {check_nodes: false, hang_timeout: null}\n")
    started = tmp_path / "started"
    proc = start_ranks(1, cfg, started, script=_STUCK_RANK)
    try:
        wait_for(started.exists, proc, "the rank's RunOps.start")
        shown = run_in_process("dump-stacks", cfg).stdout
        text = stacks_file(tmp_path / "run", 0).read_text()
    finally:
        proc.kill()
    assert f"rank 0 (pid {proc.pid}): " in shown
    assert "packtrain dump-stacks" in text and "waiting_in_a_collective" in text and "--- GPU ---" in text


def test_dump_stacks_without_a_running_rank_is_an_error(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"# packtrain train cfg.yaml\noutput_dir: {tmp_path / 'run'}\n")
    proc = run_in_process("dump-stacks", cfg, check=False)
    assert proc.returncode == 2 and "no running rank" in proc.stderr
