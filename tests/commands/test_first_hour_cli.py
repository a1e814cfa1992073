"""Issue 57, as a user coming from axolotl or TRL types it: ranks that all work, logs a cluster can read, a resume
that continues the job it was started as, and one rule for relative paths."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_helpers import REPO, free_port, metrics_of, run_in_process, run_ranks, write_config

from packtrain import faults

pytestmark = pytest.mark.process

DEMO = REPO / "configs" / "demo.yaml"
QUICK = ("--set", "train.max_steps=2", "--set", "generate.every=null", "--set", "data.eval=null")


def _steps(run) -> list[dict]:
    return [r for r in metrics_of(run) if "split" not in r]


def test_two_ranks_of_the_demo_config_each_train_a_pack(tmp_path):
    # as users launch: accelerate launch --multi_gpu --num_processes 2 (2 gloo ranks on the CPU)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--main_process_port", str(free_port()), "-m", "packtrain", "train", str(DEMO),
                           "--set", f"output_dir={tmp_path / 'run'}", *QUICK],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 steps (5 per epoch, 2 packs per step (1 per rank))" in proc.stdout
    utilisation = float(proc.stdout.split("train.balance cost: utilisation ", 1)[1].split()[0])
    assert utilisation > 0.9  # no rank idles: a step's two packs differ only in their prompts' lengths
    assert [r["packs"] for r in _steps(tmp_path / "run")] == [2, 2]


def test_fewer_packs_per_step_than_ranks_is_warned_naming_the_fix(tmp_path):
    proc = run_ranks(2, "train", DEMO, "--set", f"output_dir={tmp_path / 'run'}", "--set", "train.packs_per_rank=2",
                     "--set", "train.packs_per_step=1", *QUICK, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "give one" in proc.stderr  # both keys: one of them
    old = tmp_path / "old.yaml"  # a config written before packs_per_rank: its global packs_per_step of 1
    raw = yaml.safe_load(DEMO.read_text())
    raw["train"].pop("packs_per_rank")
    raw["train"]["packs_per_step"] = 1
    raw["data"] = {**raw["data"], **{k: str((DEMO.parent / raw["data"][k]).resolve())
                                     for k in ("train", "eval", "chat_template")}}
    old.write_text(yaml.safe_dump(raw))
    proc = run_ranks(2, "train", old, "--set", f"output_dir={tmp_path / 'old'}", *QUICK)
    warning = "WARNING: train.packs_per_step 1 over 2 ranks leaves 1 of them idle at every step (utilisation at most 0.50)"
    said = " ".join(proc.stdout.split())  # wrapped at 120 columns
    assert proc.stdout.startswith(warning) and said.count(warning) == 2  # first, and in the header again
    assert f"{warning}: set train.packs_per_rank (packs each rank trains per step: 1 gives 2 per step)" in said
    assert "train.balance cost: utilisation 0.500" in proc.stdout
    plan = run_in_process("plan", old, "--world-size", "2")
    assert warning in " ".join(plan.stdout.split())


def test_a_log_file_gets_plain_lines_and_a_resume_keeps_the_overrides(tmp_path):
    cfg = write_config(tmp_path, train={"epochs": 10, "packs_per_step": 2, "save_every": 5}, data={"eval": None},
                       logging={"progress": True, "every": 5})
    run = tmp_path / "run"
    # stdout and stderr are files, as `> log 2>&1` makes them (a process of its own: run_ranks' one rank): no bar,
    # one plain line every 5 steps
    first = run_ranks(1, "train", str(cfg), "--set", "train.max_steps=18", env={faults.SIGTERM_IN_STEP: "8"},
                      check=False)
    assert first.returncode == 75, first.stderr[-2000:]
    log = first.stdout + first.stderr
    assert "\r" not in log
    lines = [line for line in first.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/18", "5/18"]
    assert "tokens seen" in lines[-1] and "positions/s" in lines[-1] and "ETA" in lines[-1]
    # Ctrl-C / SIGTERM is acknowledged at once, and the stop says the overrides are kept
    assert "SIGTERM received: stopping after the step that is running" in first.stderr
    assert "overrides.json and kept" in first.stderr
    assert json.loads((run / "overrides.json").read_text()) == ["train.max_steps=18"]

    resumed = run_in_process("train", cfg, "--resume")
    assert "--set train.max_steps=18 (kept from the run's start)" in resumed.stdout
    steps = _steps(run)
    assert steps[-1]["step"] == 18 and len(steps) == 18

    again = run_in_process("train", cfg, "--resume")  # finished: said, nothing trained, exit 0
    assert again.returncode == 0
    assert "is finished: its final adapter" in again.stderr and "from step 18 of 18" in again.stderr
    assert _steps(run) == steps

    # a key given again takes the new value: max_steps 20 continues the finished run to 20
    more = run_in_process("train", cfg, "--resume", "--set", "train.max_steps=20")
    assert "--set train.max_steps=20 (given now)" in more.stdout
    assert _steps(run)[-1]["step"] == 20


def test_relative_paths_resolve_against_the_config_file_and_its_run_config_runs_again(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    cfg = write_config(folder, train={"max_steps": 2, "save_every": 100}, data={"eval": None})
    raw = yaml.safe_load(cfg.read_text())
    raw["data"]["train"] = "train.jsonl"  # beside the config
    raw["output_dir"] = "runs/first"
    cfg.write_text(yaml.safe_dump(raw))
    run_in_process("train", cfg)  # from the working directory (the repository's root), another directory
    run = folder / "runs" / "first"
    assert (run / "adapter").is_dir() and not (Path.cwd() / "runs" / "first").exists()
    written = yaml.safe_load((run / "config.yaml").read_text())
    assert written["output_dir"] == str(run) and written["data"]["train"] == str(folder / "train.jsonl")
    # the run directory's config.yaml, moved elsewhere, runs again as it is
    moved = tmp_path / "elsewhere" / "config.yaml"
    moved.parent.mkdir()
    shutil.copy(run / "config.yaml", moved)
    proc = run_in_process("train", moved, "--resume")
    assert "is finished" in proc.stderr
    proc = run_in_process("train", moved, "--set", f"output_dir={tmp_path / 'second'}")
    assert metrics_of(tmp_path / "second")[-1]["step"] == 2
