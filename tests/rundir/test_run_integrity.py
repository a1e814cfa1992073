"""A resumed run is the run it continues, or it is refused: a config that trains fewer steps than were already
trained, an edited state.json, a stop at an evaluation boundary, a refused resume that had already moved files
(issue 28's probes, through the CLI in this process)."""

import json
import shutil

import pytest
import torch
from cli_helpers import RESUMED, adapter_of, refused, run_in_process, write_config
from safetensors.torch import load_file

from packtrain.exits import PREEMPTED_EXIT
from packtrain.faults import SIGTERM_IN_STEP
from packtrain.rundir.checkpoint import CheckpointDamaged, checkpoints, file_digest, verify_checkpoint, write_state

SHORT = {"train": {"max_steps": 3, "save_every": 2}}  # constant schedule: a changed total of steps is allowed


def _copy(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished.run, run)
    return finished.config, run


def _tree(run):
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("max_steps", [1, 2])
def test_a_resume_below_what_was_trained_is_refused_and_keeps_the_final_adapter(trained, tmp_path, max_steps):
    """A finished 3-step run (checkpoint step-2, adapter from step 3). Before: `--resume --set train.max_steps=1`
    (or 2) exited 0 and replaced the final adapter with step 2's; the header said one number, the bar another."""
    cfg, run = _copy(trained(**SHORT), tmp_path)
    before = _tree(run)
    err = refused(run_in_process("train", cfg, "--resume", "--set", f"output_dir={run}", "--set",
                                  f"train.max_steps={max_steps}", check=False))
    assert f"this config trains {max_steps} steps" in err, err
    assert "its final adapter is from step 3" in err, err
    assert ("its newest valid checkpoint is step 2" in err) == (max_steps < 2), err
    assert "at least 3" in err
    after = _tree(run)
    assert {k: v for k, v in after.items() if k != "packtrain.lock"} == before  # nothing written, nothing moved


def test_a_checkpoint_past_the_new_total_is_refused_without_a_final_adapter(trained, tmp_path):
    cfg, run = _copy(trained(**SHORT), tmp_path)
    shutil.rmtree(run / "adapter")  # a run stopped before its end
    err = refused(run_in_process("train", cfg, "--resume", "--set", f"output_dir={run}", "--set",
                                  "train.max_steps=1", check=False))
    assert "this config trains 1 steps" in err and "its newest valid checkpoint is step 2" in err, err
    assert "final adapter" not in err.split("is past that:")[1].split(". A resume")[0]
    assert not (run / "adapter").exists()
    # the same total as the checkpoint: nothing left to train, and the adapter it writes is step 2's own
    run_in_process("train", cfg, "--resume", "--set", f"output_dir={run}", "--set", "train.max_steps=2")
    saved = {k.replace(".default", ""): v
             for k, v in load_file(str(run / "checkpoints/step-2/trainable.safetensors")).items()}
    adapter = adapter_of(run)
    assert adapter.keys() == saved.keys() and all(torch.equal(adapter[k], saved[k]) for k in adapter)


def test_an_edited_state_json_is_damaged(trained, tmp_path):
    """Before: "step": 2 -> 3 in step-2/state.json resumed "from step 3" (one pack never trained), exit 0."""
    cfg, run = _copy(trained(**SHORT), tmp_path)
    ckpt = run / "checkpoints/step-2"
    state = json.loads((ckpt / "state.json").read_text())
    for key, value in (("step", 3), ("nonfinite_skips", 1), ("epoch", 1), ("plan", "0" * 16)):
        (ckpt / "state.json").write_text(json.dumps({**state, key: value}, indent=2))
        with pytest.raises(CheckpointDamaged, match="state.json: contents differ from the digest in state.sha256"):
            verify_checkpoint(ckpt)
    # whoever rewrites the digest too still cannot make the state disagree with itself or its directory
    for edit, problem in (({"step": 3}, "step 3 in a directory named step-2"),
                          ({"total_steps": 1}, "step 2 is not within the run's total_steps 1"),
                          ({"nonfinite_skips": 5}, "nonfinite_skips 5 is not within 0..2")):
        write_state(ckpt, {**state, **edit})
        with pytest.raises(CheckpointDamaged, match=problem):
            verify_checkpoint(ckpt)
    (ckpt / "state.sha256").unlink()
    with pytest.raises(CheckpointDamaged, match="state.sha256: missing"):
        verify_checkpoint(ckpt)
    (ckpt / "state.json").write_text(json.dumps({**state, "step": 3}, indent=2))
    (ckpt / "state.sha256").write_text(file_digest(ckpt / "state.json"))
    shutil.rmtree(run / "adapter")
    err = refused(run_in_process("train", cfg, "--resume", "--set", f"output_dir={run}", check=False))
    assert "every checkpoint is damaged" in err and "step 3 in a directory named step-2" in err, err
    assert not (run / "adapter").exists()


def test_a_stop_after_an_epochs_last_step_runs_that_epochs_eval_on_resume(trained, tmp_path):
    """SIGTERM during step 6, the first epoch's last: the checkpoint is written before that epoch's evaluation.
    Before, the resumed run never ran it (eval lines at steps [0, 12] instead of [0, 6, 12], and
    docs/operations.md promises one at each epoch's end). Now state.json says what the step still owed."""
    straight = trained(**RESUMED)
    cfg, run = straight.config, tmp_path / "run"
    stopped = run_in_process("train", cfg, "--set", f"output_dir={run}", env={SIGTERM_IN_STEP: "6"}, check=False)
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-3000:]
    assert checkpoints(run)[0].name == "step-6"
    assert verify_checkpoint(checkpoints(run)[0])["owed"] == ["eval"]

    def evals(r):
        return [(x["step"], x["loss"]) for x in map(json.loads, (r / "metrics.jsonl").read_text().splitlines())
                if x.get("split") == "eval"]

    assert [s for s, _ in evals(run)] == [0]
    without_eval = tmp_path / "without-eval"
    shutil.copytree(run, without_eval)
    run_in_process("train", cfg, "--set", f"output_dir={run}", "--resume")
    assert [s for s, _ in evals(straight.run)] == [0, 6, 12]
    assert evals(run) == evals(straight.run)  # the same losses: the eval ran on step 6's restored adapter
    a, b = (adapter_of(r) for r in (straight.run, run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # data.eval removed on resume (an allowed change): the owed evaluation has nothing to run on, and is skipped
    run_in_process("train", cfg, "--set", f"output_dir={without_eval}", "--resume", "--set", "data.eval=null")
    assert [s for s, _ in evals(without_eval)] == [0]


def test_a_refused_resume_moves_no_damaged_checkpoint(trained, tmp_path):
    """Before: a resume with another optim.lr was refused, but had already renamed the damaged newest checkpoint
    to damaged-step-N; the docs say a refusal changes nothing."""
    cfg, run = _copy(trained(**RESUMED), tmp_path)
    newest = checkpoints(run)[0]
    weights = newest / "trainable.safetensors"
    data = bytearray(weights.read_bytes())
    data[-9] ^= 0x01
    weights.write_bytes(bytes(data))
    names = [p.name for p in (run / "checkpoints").iterdir()]
    err = refused(run_in_process("train", cfg, "--resume", "--set", f"output_dir={run}", "--set",
                                  "optim.lr=0.002", check=False))
    assert "belongs to another run" in err and "optim.lr" in err, err
    assert [p.name for p in (run / "checkpoints").iterdir()] == names


@pytest.mark.process
@pytest.mark.distributed
def test_two_ranks_both_refuse_a_resume_below_what_was_trained(trained, tmp_path):
    """Rank 0 reads the final adapter's step and every rank gets it: both refuse, neither waits for the other."""
    from cli_helpers import run_ranks

    cfg, run = _copy(trained(**SHORT), tmp_path)
    proc = run_ranks(2, "train", str(cfg), "--resume", "--set", f"output_dir={run}", "--set", "train.max_steps=2",
                     check=False, timeout=120)
    assert proc.returncodes == [2, 2], (proc.returncodes, proc.stderr[-3000:])
    assert proc.stderr.count("its final adapter is from step 3") == 2, proc.stderr[-3000:]


def test_a_stop_where_a_generation_is_owed_runs_it_on_resume(tmp_path):
    """SIGTERM during step 2 with generate.every: 2: the checkpoint is written before step 2's generation and owes
    it; the resumed run writes the generations/step-2.jsonl of an uninterrupted run before its next step."""
    sections = {"generate": {"every": 2, "examples": 2, "max_new_tokens": 3},
                "train": {"max_steps": 3, "packs_per_step": 1, "save_every": 100}}
    cfg = write_config(tmp_path, **sections)
    straight, run = tmp_path / "straight", tmp_path / "run"
    uninterrupted = run_in_process("train", cfg, "--set", f"output_dir={straight}")
    stopped = run_in_process("train", cfg, env={SIGTERM_IN_STEP: "2"}, check=False)
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-3000:]
    assert verify_checkpoint(checkpoints(run)[0])["owed"] == ["generate"]
    assert sorted(p.name for p in (run / "generations").glob("*.jsonl")) == ["step-0.jsonl"]
    resumed = run_in_process("train", cfg, "--resume")
    for step in (0, 2, 3):
        name = f"generations/step-{step}.jsonl"
        assert (run / name).read_text() == (straight / name).read_text(), name

    def footer(proc):  # the resumed run's footer dropped both lines: step 0 ran before the stop
        return [x for x in proc.stdout.splitlines() if x.startswith(("eval loss: ", "task score: "))]

    assert len(footer(uninterrupted)) == 2 and footer(resumed) == footer(uninterrupted)
