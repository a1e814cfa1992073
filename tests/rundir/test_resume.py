"""Resume means the same run: trajectory keys and edited data refuse the resume with every difference listed;
other keys may change and are reported (the real CLI, in this process). The rule table itself is checked key by
key."""

import json

import pytest
from cli_helpers import run_in_process, write_config

from packtrain.rundir.resume import compare, is_trajectory


@pytest.mark.parametrize("key,trajectory", [
    ("optim.lr", True), ("optim.name", True), ("lora.r", True), ("model.dtype", True), ("model.config", True),
    ("packing.token_budget", True), ("packing.mode", True), ("train.seed", True),
    ("data.processor", True), ("train.objective", True), ("train.dpo_beta", True), ("train.rpo_alpha", True),
    ("train.dpo_loss_type", True),
    ("model.kernels", False), ("train.max_steps", False), ("train.epochs", False), ("train.save_every", False),
    ("train.eval_every", False), ("train.keep_checkpoints", False), ("train.max_nonfinite_skips", False),
    ("train.device", False), ("logging.progress", False), ("ops.hang_timeout", False), ("output_dir", False),
    ("data.train", False),  # data is compared by its tokens (the plan fingerprint), not by path
    # compared as the count the run used (packs_per_rank x world size, or packs_per_step): check_same_run
    ("train.packs_per_step", False), ("train.packs_per_rank", False),
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
    for line in ("optim.lr: 0.001 -> 0.5", "train.seed: 0 -> 3", "packs per step: 1 (written at world size 1) -> 2",
                 "lora.r: 4 -> 2",
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


def test_a_finished_run_without_a_checkpoint_is_reported_finished_not_restarted(tmp_path, trained):
    # save_every 100 over the run's 3 steps: the run finished with its adapter and no checkpoint. Before, --resume said
    # "no checkpoint ...; starting from step 0", compared no config, trained again and replaced the adapter (exit 0);
    # now it says the run is finished (exit 0, nothing trained), whatever it was given; with more steps asked for it
    # is refused: there is no checkpoint to continue from
    import shutil

    finished = trained()
    run = tmp_path / "run"
    shutil.copytree(finished.run, run)
    assert (run / "adapter").is_dir() and not (run / "checkpoints").exists()
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = run_in_process("train", finished.config, "--set", f"output_dir={run}", "--resume",
                          "--set", "optim.lr=0.5", "--set", "lora.r=4", check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line == (f"packtrain train: {run} is finished: its final adapter {run / 'adapter'} is from step 3 of 3; "
                    "nothing to train (to train further, start a new run from its adapter (model.adapter): it saved "
                    "no checkpoint to continue from)"), line
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing touched
    proc = run_in_process("train", finished.config, "--set", f"output_dir={run}", "--resume",
                          "--set", "train.max_steps=5", "--set", "train.epochs=5", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"packtrain train: error: resume refused: {run} holds a finished run (its final adapter "
                           f"{run / 'adapter'} is from step 3) and no checkpoint to continue from"), line
    assert "starting from step 0" not in proc.stdout
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing touched


def test_changed_weights_or_objective_settings_refuse_the_resume_naming_each(tmp_path):
    """A dpo run with pair weights (stopped after step 1's checkpoint): a resume with one pair's weight changed in the
    data (the tokens all equal) is refused naming the weights; with train.dpo_beta, train.rpo_alpha or
    train.dpo_loss_type changed, naming each (they were listed as allowed changes and trained on); unchanged, it
    resumes."""
    from cli_helpers import write_pair_data

    from packtrain.faults import SIGTERM_IN_STEP

    pairs = write_pair_data(tmp_path / "pairs.jsonl")
    lines = [json.loads(line) for line in pairs.read_text().splitlines()]
    pairs.write_text("".join(json.dumps({**x, "weight": 1.5 if i % 2 else 0.5}) + "\n" for i, x in enumerate(lines)))
    cfg = write_config(tmp_path, data={"train": str(pairs), "eval": None},
                       train={"objective": "dpo", "max_steps": 3, "save_every": 1, "dpo_reference": "per_step"})
    stopped = run_in_process("train", cfg, env={SIGTERM_IN_STEP: "1"}, check=False)
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    kept = pairs.read_text()

    pairs.write_text(kept.replace('"weight": 1.5', '"weight": 2.5', 1))
    proc = run_in_process("train", cfg, "--resume", check=False)
    assert proc.returncode == 2 and '"weight" values differ' in proc.stderr, proc.stderr[-2000:]
    assert "the tokens of" not in proc.stderr and "->" not in proc.stderr.split("resume refused")[1]
    pairs.write_text(kept)

    proc = run_in_process("train", cfg, "--resume", "--set", "train.dpo_beta=0.2", "--set", "train.rpo_alpha=1.0",
                          "--set", "train.dpo_loss_type=ipo", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    for line in ("train.dpo_beta: 0.1 -> 0.2", "train.rpo_alpha: 0.0 -> 1.0", "train.dpo_loss_type: 'sigmoid' -> 'ipo'"):
        assert line in proc.stderr.split("resume refused")[1], (line, proc.stderr[-2000:])
    assert '"weight"' not in proc.stderr

    resumed = run_in_process("train", cfg, "--resume")
    assert "continuing from" in resumed.stdout
