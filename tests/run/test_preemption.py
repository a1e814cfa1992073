"""Preemption through the real CLI, in processes that are signalled (forked with packtrain imported:
cli_helpers.start_ranks): SIGTERM / SIGINT (sent by pid once a step is logged, never after a bare sleep) end the run
at the next step boundary with a checkpoint and exit 75; --resume then gives the uninterrupted run's adapter bit for
bit. With two ranks, SIGINT to rank 1 alone stops both at the same step (no KeyboardInterrupt), and the resume
restores both ranks' RNG (each rank trains a pack per step, with dropout). These are the suite's proofs of those two
resume paths (SIGKILL: commands/test_train; 2 -> 1 ranks: test_distributed).

Every run of one comparison has the same torch thread count, one (the forked ranks and the pytest process:
cli_helpers, conftest.py): torch's own CPU kernels do not round the same with 1 and 2 threads (its flash attention in
float64 gives outputs 1 ulp apart for query blocks of odd length 9-31, `tools/experiments/thread_rounding.py`), so a
bit-for-bit comparison across thread counts would test torch, not the resume."""

import json
import os
import signal

import pytest
from cli_helpers import RESUMED, adapter_of, assert_equal_adapters, run_in_process, run_ranks, write_config
from long_run_helpers import finish, no_packtrain_traceback, rank_pid, start_cli, steps_logged, wait_for

from packtrain.exits import PREEMPTED_EXIT
from packtrain.rundir.checkpoint import checkpoints, verify_checkpoint

pytestmark = pytest.mark.process


def _config(tmp_path, **sections):
    return write_config(tmp_path, **{**RESUMED, **sections})


def _preempt(proc, run, sig, pid=None):
    wait_for(lambda: steps_logged(run) >= 1 and (pid is None or pid()), proc, "step 1 in metrics.jsonl")
    os.kill(pid() if pid is not None else proc.pid, sig)
    return finish(proc)


def _assert_preempted(run, code, err, sig_name, steps=12):
    assert code == PREEMPTED_EXIT, err[-3000:]
    assert no_packtrain_traceback(err)
    lines = [x for x in err.splitlines() if "stopped by" in x]
    assert len(lines) == 1 and f"stopped by {sig_name} after step" in lines[0], err[-3000:]
    step = int(lines[0].split("after step ")[1].split()[0])
    newest = checkpoints(run)[0]
    assert newest.name == f"step-{step}" and verify_checkpoint(newest)["step"] == step
    assert "--resume" in lines[0] and not (run / "adapter").exists()
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
              if '"split"' not in x]
    assert logged[-1] == step and 1 <= step < steps
    return step


def test_sigterm_checkpoints_and_resume_gives_the_uninterrupted_adapter(tmp_path, trained):
    straight = trained(**RESUMED)  # in this process, one thread
    cfg = _config(tmp_path)
    run = tmp_path / "run"
    code, _, err = _preempt(start_cli("train", str(cfg)), run, signal.SIGTERM)
    _assert_preempted(run, code, err, "SIGTERM")
    resumed = run_in_process("train", cfg, "--resume")
    assert "continuing from" in resumed.stdout
    assert_equal_adapters(adapter_of(straight.run), adapter_of(run))


@pytest.mark.distributed
def test_sigint_to_one_rank_stops_both_and_resume_matches(tmp_path):
    # two packs per step: one on each rank, so rank 1's restored RNG draws real dropout masks (6 steps)
    cfg = _config(tmp_path, data={"eval": None}, train={**RESUMED["train"], "packs_per_step": 2})
    run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'straight'}")
    run = tmp_path / "run"
    proc = start_cli("train", str(cfg), ranks=2)
    _, _, err = _preempt(proc, run, signal.SIGINT, pid=lambda: rank_pid(run, 1))
    assert proc.returncodes == [PREEMPTED_EXIT, PREEMPTED_EXIT], (proc.returncodes, err[-3000:])
    # rank 0 was never signalled: it stopped at the step rank 1 did, and said so once
    step = _assert_preempted(run, PREEMPTED_EXIT, err, "a signal on another rank", steps=6)
    assert "KeyboardInterrupt" not in err
    assert (checkpoints(run)[0] / "rng-rank-1.pt").exists() and step >= 1
    run_ranks(2, "train", str(cfg), "--resume")
    assert_equal_adapters(adapter_of(tmp_path / "straight"), adapter_of(run))


def test_a_signal_during_setup_is_a_clean_stop_too(tmp_path):
    cfg = _config(tmp_path, data={"eval": None})
    run = tmp_path / "run"
    proc = start_cli("train", str(cfg))
    # the rank file appears in setup, after the handlers are installed and before the model is built
    wait_for(lambda: rank_pid(run, 0), proc, "OUTPUT/ops/rank-0.json")
    os.kill(proc.pid, signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == PREEMPTED_EXIT and no_packtrain_traceback(err), err[-3000:]
    (line,) = [x for x in err.splitlines() if "stopped by SIGTERM after step" in x]
    if "after step 0 of" in line:  # the usual case: still in setup when the signal came
        assert "nothing trained yet" in line and not checkpoints(run)
    else:  # a fast machine finished setup first: a normal preemption
        assert verify_checkpoint(checkpoints(run)[0])
