"""`accelerate launch` as users type it, on CPU: two invocations of launch/cpu_two_machines.yaml act as 2 machines x 2
processes on this host (gloo), and train the adapter 1 rank trains. (torchrun stays supported: tests/test_distributed.py
runs launch/cpu_two_processes.sh.)"""

import os
import subprocess
import sys

import pytest
import torch
from cli_helpers import REPO, SGD, adapter_of, free_port, run_in_process, train_losses, write_config

pytestmark = [pytest.mark.process, pytest.mark.distributed]


def accelerate_machines(cfg, out, machines: int = 2, *extra: str, config="cpu_two_machines.yaml", timeout=300,
                        launcher=(), per_machine=None):
    """One `accelerate launch --config_file launch/CONFIG --machine_rank r` per machine, all at once; their
    (returncode, stdout, stderr). ``launcher``: more accelerate options; ``per_machine[r]``: more train arguments
    for machine r only."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                               str(REPO / "launch" / config), "--machine_rank", str(r), "--main_process_port", port,
                               *launcher, "-m", "packtrain", "train", str(cfg), "--set", f"output_dir={out}", *extra,
                               *(per_machine or {}).get(r, ())],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for r in range(machines)]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            results.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def test_two_machines_of_two_processes_give_the_one_rank_adapter(tmp_path):
    # 3 packs per step on 4 ranks: one rank runs a dummy unit every step; SGD: the adapter is a plain function of
    # the summed gradients
    cfg = write_config(tmp_path, optim=SGD, data={"eval": None}, train={"max_steps": 2, "packs_per_step": 3})
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'one'}")
    results = accelerate_machines(cfg, tmp_path / "four")
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
    out = results[0][1]
    said = " ".join(out.split())  # the header wraps at 120 columns
    assert "world size 4" in said and "FSDP2 over 4 ranks" in said
    # train's check-nodes table, grouped by machine (GROUP_RANK from the launcher)
    assert "check-nodes: 4 ranks on 2 machines, 1 host (all identical)" in out
    assert "  machine 0 (" in out and "): ranks 0-1, as the majority" in out and "): ranks 2-3, as the majority" in out
    ref, four = adapter_of(tmp_path / "one"), adapter_of(tmp_path / "four")
    assert ref.keys() == four.keys() and ref
    for name in ref:  # float64: only the order of the cross-rank sums differs
        torch.testing.assert_close(four[name], ref[name], rtol=1e-10, atol=1e-13)
    assert train_losses(tmp_path / "four") == pytest.approx(train_losses(tmp_path / "one"), rel=1e-10)


def test_machines_started_with_different_configs_refuse_before_writing_anything(tmp_path):
    # machine 1 was given another learning rate: before, both trained (exit 0), each rank with its own lr, and the
    # run directory recorded rank 0's. One process per machine: the refusal comes before the model is built.
    cfg = write_config(tmp_path, optim=SGD, data={"eval": None}, train={"max_steps": 1})
    results = accelerate_machines(cfg, tmp_path / "run", 2, launcher=("--num_processes", "2"),
                                  per_machine={1: ("--set", "optim.lr=0.25")}, timeout=240)
    for code, _, stderr in results:
        assert code != 0, stderr[-3000:]
        assert "ranks were started with different configs" in stderr, stderr[-3000:]
        assert "optim.lr: 0.5 on rank 0 (machine 0), 0.25 on rank 1 (machine 1)" in stderr, stderr[-3000:]
        # the launcher prints its own traceback for a failed worker; the worker's is not there
        assert "packtrain/run/trainer.py" not in stderr and "exitcode  : 2" in stderr, stderr[-3000:]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
