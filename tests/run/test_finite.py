"""Finite or stop, through the real CLI (in this process; two ranks as processes): a diverging run exits 4 at its
first NaN/inf step without an update and without writing NaN anywhere; a parameter that an update made non-finite
is never saved; train.max_nonfinite_skips skips such steps, counted in metrics.jsonl. The finite check's verdict and
its message (packtrain/run/finite.py), in process."""

import json
import math
import re

import pytest
import torch
from cli_helpers import run_in_process, run_ranks, write_config
from long_run_helpers import no_packtrain_traceback, nonfinite_files
from torch.optim.optimizer import register_optimizer_step_post_hook

from packtrain.config import config_from_dict
from packtrain.exits import NONFINITE_EXIT
from packtrain.faults import NAN_AT as INJECT_ENV
from packtrain.run.finite import is_finite, stop_message
from packtrain.rundir.checkpoint import checkpoints, verify_checkpoint


def _train_lines(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"split"' not in x]


def _assert_stopped_cleanly(run, stderr, step):
    """Exit 4's promise: the message, the last good checkpoint intact, no adapter, nothing non-finite on disk."""
    assert no_packtrain_traceback(stderr)
    assert f"step {step}: loss " in stderr and "stopped before the update" in stderr
    for hint in ("optim.lr", "optim.max_grad_norm", "optim.warmup_steps", "train.max_nonfinite_skips"):
        assert hint in stderr, hint
    assert not (run / "adapter").exists()
    newest = checkpoints(run)[0]
    assert newest.name == f"step-{step - 1}" and verify_checkpoint(newest)["step"] == step - 1
    assert f"{newest}, is intact" in stderr
    assert nonfinite_files(run) == []
    assert _train_lines(run)[-1]["step"] == step - 1


def test_a_diverging_learning_rate_stops_at_the_first_nan_step(tmp_path):
    # the reproduction: lr=1e20 gave NaN checkpoints, a NaN adapter and exit 0
    cfg = write_config(tmp_path, train={"epochs": 2, "packs_per_step": 1, "save_every": 1})
    proc = run_in_process("train", cfg, "--set", "optim.lr=1e20", check=False)
    assert proc.returncode == NONFINITE_EXIT, proc.stderr[-3000:]
    step = int(re.search(r"step (\d+): loss \S+, gradient norm (nan|inf)", proc.stderr).group(1))
    assert step >= 2
    _assert_stopped_cleanly(tmp_path / "run", proc.stderr, step)


def test_a_nan_step_stops_then_resume_skips_it_and_counts_it(tmp_path):
    cfg = write_config(tmp_path, train={"epochs": 1, "packs_per_step": 1, "save_every": 1})
    run = tmp_path / "run"
    nan_at_3 = {INJECT_ENV: "0:3"}
    stopped = run_in_process("train", cfg, env=nan_at_3, check=False)
    assert stopped.returncode == NONFINITE_EXIT, stopped.stderr[-3000:]
    _assert_stopped_cleanly(run, stopped.stderr, 3)

    resumed = run_in_process("train", cfg, "--resume", "--set", "train.max_nonfinite_skips=1", env=nan_at_3)
    assert "step 3: " in resumed.stdout and "skipped without an update (1 of train.max_nonfinite_skips=1)" in \
        resumed.stdout
    lines = _train_lines(run)
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    assert [x["nonfinite"] for x in lines] == [False, False, True, False, False, False]
    assert [x["nonfinite_skips"] for x in lines] == [0, 0, 1, 1, 1, 1]
    assert lines[2]["loss"] is None and lines[2]["grad_norm"] is None
    assert (run / "adapter").exists() and nonfinite_files(run) == []


def test_the_skip_count_survives_a_resume(tmp_path):
    """train.max_nonfinite_skips counts over the whole run: a skip before a checkpoint still counts after resuming
    from it, so a second NaN step past the limit stops the resumed run (exit 4) instead of being skipped."""
    cfg = write_config(tmp_path, train={"max_steps": 4, "packs_per_step": 1, "save_every": 1,
                                        "max_nonfinite_skips": 1}, data={"eval": None})
    run = tmp_path / "run"
    run_in_process("train", cfg, env={INJECT_ENV: "0:3"})  # step 3 skipped; checkpoints up to step-3
    assert verify_checkpoint(checkpoints(run)[0])["nonfinite_skips"] == 1
    resumed = run_in_process("train", cfg, "--resume", "--set", "train.max_steps=6", env={INJECT_ENV: "0:6"},
                             check=False)
    assert resumed.returncode == NONFINITE_EXIT, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "after 1 skipped non-finite step(s)" in resumed.stderr
    assert [x["nonfinite_skips"] for x in _train_lines(run)] == [0, 0, 1, 1, 1]


@pytest.mark.parametrize("save_every", [1, 100], ids=["checkpoint", "final adapter"])
def test_a_parameter_an_update_made_non_finite_is_never_saved(tmp_path, save_every):
    """Step 2's loss and gradient norm are finite, but its update leaves an inf in a parameter (an overflowing
    update; here written by an optimizer hook): the save after it, step 2's checkpoint or the final adapter, checks
    the parameters themselves and stops the run with exit 4, so nothing non-finite reaches the disk. (No eval data:
    an eval after the update would see a NaN loss first.)"""
    cfg = write_config(tmp_path, train={"max_steps": 2, "packs_per_step": 1, "save_every": save_every},
                       data={"eval": None})
    updates = []

    def overflow_in_update_2(optimizer, args, kwargs):
        updates.append(optimizer)
        if len(updates) == 2:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].view(-1)[0] = float("inf")

    hook = register_optimizer_step_post_hook(overflow_in_update_2)
    try:
        proc = run_in_process("train", cfg, check=False)
    finally:
        hook.remove()
    run = tmp_path / "run"
    assert proc.returncode == NONFINITE_EXIT and len(updates) == 2, proc.stderr[-3000:]
    assert "step 2: a trainable parameter is NaN or inf; nothing was saved" in proc.stderr, proc.stderr[-3000:]
    assert not (run / "adapter").exists()
    assert [p.name for p in checkpoints(run)] == (["step-1"] if save_every == 1 else [])
    assert nonfinite_files(run) == []


@pytest.mark.process
@pytest.mark.distributed
def test_a_nan_on_one_rank_stops_both_at_the_same_step(tmp_path):
    cfg = write_config(tmp_path, train={"epochs": 1, "packs_per_step": 2, "save_every": 1}, data={"eval": None})
    proc = run_ranks(2, "train", str(cfg), env={INJECT_ENV: "1:2"}, check=False, timeout=180)
    # rank 0 never saw a NaN of its own, yet it stops at rank 1's step: both exit 4
    assert proc.returncodes == [NONFINITE_EXIT, NONFINITE_EXIT], (proc.returncodes, proc.stderr[-3000:])
    assert proc.stderr.count("step 2: loss ") == 1  # one message, from rank 0
    _assert_stopped_cleanly(tmp_path / "run", proc.stderr, 2)


def test_finite_verdict_and_message():
    assert is_finite(1.0, 0.5) and not is_finite(1.0, math.nan) and not is_finite(math.inf, 0.5)
    cfg = config_from_dict({"optim": {"lr": 1e20}, "model": {"dtype": "bfloat16"}})
    msg = stop_message(7, math.nan, math.inf, cfg, "run/checkpoints/step-6", skips=0)
    assert msg.startswith("step 7: loss nan, gradient norm inf")
    for part in ("run/checkpoints/step-6, is intact", "optim.lr (now 1e+20)", "model.dtype float32",
                 "--resume --set train.max_nonfinite_skips=N"):
        assert part in msg, part
    assert "no checkpoint was written yet" in stop_message(1, math.nan, 0.0, cfg, None, skips=0)
