"""Checkpoints that can be trusted, through the real CLI: retention, digests, fallback past damaged checkpoints to
the uninterrupted run's adapter, no code run from a crafted pickle, leftovers and a cut-off metrics line."""

import json
import os
import pickle
import shutil

import pytest
import torch
from cli_helpers import run_cli, write_config
from safetensors.torch import load_file

from packtrain.rundir.checkpoint import CheckpointDamaged, checkpoints, file_digest, verify_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One run of 6 steps with a checkpoint after every step (dropout and a cosine schedule: RNG and scheduler
    state matter on resume); keep_checkpoints left at its default, 3."""
    tmp = tmp_path_factory.mktemp("finished")
    cfg = write_config(tmp, train={"epochs": 1, "packs_per_step": 1, "save_every": 1}, lora={"dropout": 0.1},
                       optim={"schedule": "cosine", "warmup_steps": 2})
    run_cli("train", str(cfg))
    return cfg, tmp / "run"


def _copy(finished, tmp_path):
    cfg, run = finished
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    return cfg, copy


def _adapter(run):
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def test_only_the_newest_three_checkpoints_are_kept(finished):
    _, run = finished
    assert [p.name for p in checkpoints(run)] == ["step-5", "step-4", "step-3"]
    assert not any(p.name.startswith((".tmp-", ".old-")) for p in (run / "checkpoints").iterdir())


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_damaged_checkpoints_fall_back_to_the_newest_valid_one_and_no_pickle_runs(finished, tmp_path):
    cfg, run = _copy(finished, tmp_path)
    marker = tmp_path / "pwned"
    sched = run / "checkpoints/step-5/scheduler.pt"
    sched.write_bytes(pickle.dumps({"last_epoch": _RunsCode(marker)}))
    state_file = run / "checkpoints/step-5/state.json"
    state = json.loads(state_file.read_text())
    state["files"]["scheduler.pt"] = file_digest(sched)  # whoever can write the file can write its digest too
    state_file.write_text(json.dumps(state))
    weights = run / "checkpoints/step-4/trainable.safetensors"
    data = bytearray(weights.read_bytes())
    data[-9] ^= 0x01  # one bit of one tensor value: same length, another digest
    weights.write_bytes(bytes(data))
    for leftover in ("checkpoints/.tmp-step-6", "checkpoints/.old-step-2-77", ".tmp-adapter-5"):
        (run / leftover).mkdir()
        (run / leftover / "x").write_text("half-written")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "epoch": 0, "lo')  # a kill mid-line
    (run / "adapter").rename(run / "adapter-straight")

    proc = run_cli("train", str(cfg), "--resume", "--set", f"output_dir={run}", "--set", "train.save_every=2")
    out = proc.stdout
    assert not marker.exists(), "torch.load ran the pickle's code"
    assert "step-5 is damaged" in out and "scheduler.pt: unreadable" in out, out
    assert "step-4 is damaged" in out and "trainable.safetensors: contents differ from the digest" in out
    assert "falling back to step-3" in out and "continuing from" in out and "step-3 (step 3" in out
    assert "changed since the checkpoint (allowed)" in out and "train.save_every: 1 -> 2" in out
    assert "metrics.jsonl: line" in out and "is damaged" in out
    for name in ("damaged-step-5", "damaged-step-4"):
        assert (run / "checkpoints" / name).is_dir()
    assert not any(p.name.startswith((".tmp-", ".old-")) for d in (run, run / "checkpoints") for p in d.iterdir())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]  # every line parses
    assert [x["step"] for x in lines if x.get("split") != "eval"] == [1, 2, 3, 4, 5, 6]
    straight, resumed = load_file(str(run / "adapter-straight" / "adapter_model.safetensors")), _adapter(run)
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name  # bitwise: step 3's state was restored whole


def test_what_verify_reports(finished, tmp_path):
    _, run = _copy(finished, tmp_path)
    ckpt = run / "checkpoints/step-3"
    assert verify_checkpoint(ckpt)["step"] == 3
    optim = run / "checkpoints/step-4/optimizer.pt"
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])  # cut off, as by a full disk
    with pytest.raises(CheckpointDamaged, match="optimizer.pt: contents differ from the digest"):
        verify_checkpoint(optim.parent)
    (ckpt / "rng-rank-0.pt").unlink()
    with pytest.raises(CheckpointDamaged, match="rng-rank-0.pt: missing"):
        verify_checkpoint(ckpt)
    (ckpt / "state.json").write_text("")
    with pytest.raises(CheckpointDamaged, match="state.json: unreadable"):
        verify_checkpoint(ckpt)
    (ckpt / "state.json").unlink()
    with pytest.raises(CheckpointDamaged, match="state.json: missing"):
        verify_checkpoint(ckpt)


def test_every_checkpoint_damaged_refuses_and_moves_nothing(finished, tmp_path):
    cfg, run = _copy(finished, tmp_path)
    for ckpt in checkpoints(run):
        (ckpt / "state.json").write_text("{")
    proc = run_cli("train", str(cfg), "--resume", "--set", f"output_dir={run}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "every checkpoint is damaged" in proc.stderr and proc.stderr.count("state.json: unreadable") == 3
    assert [p.name for p in checkpoints(run)] == ["step-5", "step-4", "step-3"]
