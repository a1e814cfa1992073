"""Resume means the same run: trajectory keys and edited data refuse the resume with every difference listed;
other keys may change and are reported (the real CLI, in this process). The rule table itself is checked key by
key."""

import json

import pytest
from cli_helpers import run_in_process, write_config

from packtrain.rundir.resume import compare, is_trajectory


@pytest.mark.parametrize("key,trajectory", [
    ("optim.lr", True), ("optim.name", True), ("lora.r", True), ("model.dtype", True), ("model.config", True),
    ("packing.token_budget", True), ("packing.mode", True), ("train.seed", True), ("train.packs_per_step", True),
    ("data.processor", True),
    ("model.kernels", False), ("train.max_steps", False), ("train.epochs", False), ("train.save_every", False),
    ("train.eval_every", False), ("train.keep_checkpoints", False), ("train.max_nonfinite_skips", False),
    ("train.device", False), ("logging.progress", False), ("ops.hang_timeout", False), ("output_dir", False),
    ("data.train", False),  # data is compared by its tokens (the plan fingerprint), not by path
])
def test_which_keys_fix_the_trajectory(key, trajectory):
    assert is_trajectory(key) is trajectory


def test_epochs_may_change_except_under_a_cosine_schedule():
    saved = {"optim": {"schedule": "constant"}, "train": {"epochs": 2}}
    now = {"optim": {"schedule": "constant"}, "train": {"epochs": 3}}
    assert compare(saved, now, 12, 18) == ([], ["train.epochs: 2 -> 3"])
    cosine = {"optim": {"schedule": "cosine"}, "train": {"epochs": 2}}
    refused, _ = compare(cosine, {**cosine, "train": {"epochs": 3}}, 12, 18)
    assert len(refused) == 1 and "total steps: 12 -> 18" in refused[0]
    assert compare(cosine, {**cosine, "train": {"epochs": 3}}, 12, 12)[0] == []  # max_steps held it at 12
    refused, _ = compare(cosine, {**cosine, "train": {"epochs": 1}}, 12, 6)  # a shorter run: the rate would jump too
    assert len(refused) == 1 and "total steps: 12 -> 6" in refused[0]
    refused, _ = compare(cosine, {**cosine, "train": {"epochs": 2, "max_steps": 11}}, 12, 11)
    assert refused and "total steps: 12 -> 11" in refused[-1]


def test_another_lr_seed_split_rank_or_optimizer_is_refused_naming_each(tmp_path):
    # a run whose newest checkpoint is step 2 (the last step saves the adapter, no checkpoint; max_steps may differ)
    cfg = write_config(tmp_path, train={"epochs": 2, "packs_per_step": 1, "save_every": 2, "max_steps": 3},
                       data={"eval": None})
    run = tmp_path / "run"
    run_in_process("train", cfg)
    written = (run / "config.yaml").read_text()
    proc = run_in_process("train", cfg, "--resume", "--set", "optim.lr=0.5", "--set", "train.seed=3",
                          "--set", "train.packs_per_step=2", "--set", "lora.r=2", "--set", "optim.name=sgd",
                          "--set", "train.max_steps=5", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr
    for line in ("optim.lr: 0.001 -> 0.5", "train.seed: 0 -> 3", "train.packs_per_step: 1 -> 2", "lora.r: 4 -> 2",
                 "optim.name: 'adamw' -> 'sgd'"):
        assert line in err, (line, err)
    assert "max_steps" not in err  # allowed: not among the refusals
    assert (run / "config.yaml").read_text() == written  # config.yaml still says what the checkpoint ran

    # the same file with one system prompt edited: every key equal, the tokens are not
    data = tmp_path / "train.jsonl"
    data.write_text(data.read_text().replace("Rulebook A.", "Rulebook Z."))
    edited = run_in_process("train", cfg, "--resume", check=False)
    assert edited.returncode == 2 and "training data: the tokens" in edited.stderr, edited.stderr[-2000:]
    assert "->" not in edited.stderr.split("resume refused")[1]  # no config key is blamed
    assert json.loads((run / "checkpoints/step-2/state.json").read_text())["step"] == 2


def test_a_finished_run_without_a_checkpoint_is_refused_not_restarted(tmp_path, trained):
    # save_every 100 over the run's 3 steps: the run finished with its adapter and no checkpoint. Before, --resume said
    # "no checkpoint ...; starting from step 0", compared no config, trained again and replaced the adapter (exit 0)
    import shutil

    finished = trained()
    run = tmp_path / "run"
    shutil.copytree(finished.run, run)
    assert (run / "adapter").is_dir() and not (run / "checkpoints").exists()
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = run_in_process("train", finished.config, "--set", f"output_dir={run}", "--resume",
                          "--set", "optim.lr=0.5", "--set", "lora.r=4", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"packtrain train: error: resume refused: {run} holds a finished run (its final adapter "
                           f"{run / 'adapter'} is from step 3) and no checkpoint to continue from"), line
    assert "starting from step 0" not in proc.stdout
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing touched
