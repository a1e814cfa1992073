"""End-to-end runs of `packtrain train` / `packtrain eval` on a tiny float64 model: the real CLI, in this process
(the kill in a process of its own)."""

import json

import pytest
import torch
from cli_helpers import (
    RESUMED,
    adapter_of,
    adapter_rel,
    assert_equal_adapters,
    metrics_of,
    run_in_process,
    run_ranks,
    write_config,
)

# 2 steps of the default tiny config: the packed run the standalone and checkpointed runs are compared with
TWO_STEPS = {"train": {"max_steps": 2}}


def test_shared_prefix_and_standalone_give_the_same_adapter(tmp_path, trained):
    packed_run = trained(**TWO_STEPS)
    run_in_process("train", packed_run.config, "--set", f"output_dir={tmp_path / 'alone'}",
                   "--set", "packing.mode=standalone")
    packed, alone = adapter_of(packed_run.run), adapter_of(tmp_path / "alone")
    assert packed.keys() == alone.keys() and packed
    # float64 as shipped: the model's float32 casts bound the agreement (tests/packed/test_parity.py: 1e-4 on grads).
    # They round at the scale of a tensor's values, so the bound is on each tensor's largest difference over its largest
    # value, as in the other packed == standalone tests: an element near zero sees the same absolute rounding (an
    # AVX-only CPU: 2.2e-9 at an element of 1.1e-3, 2e-6 of it; the tensors' scales are 0.13-0.5). Measured there:
    # 4.7e-8; tests/mutations.py's broken plumbings give 6.1e-5 (zero initial state) to 1.8e-2 (tail off by one).
    assert adapter_rel(packed, alone) < 1e-6
    steps = [m for m in metrics_of(packed_run.run) if m.get("split") != "eval"]
    steps_alone = [m for m in metrics_of(tmp_path / "alone") if m.get("split") != "eval"]
    assert [m["examples"] for m in steps] == [m["examples"] for m in steps_alone]
    assert [m["positions"] for m in steps] < [m["positions"] for m in steps_alone]  # sharing P: fewer positions
    for a, b in zip(steps, steps_alone):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_activation_checkpointing_saves_the_same_adapter(tmp_path, trained):
    """Checkpointing changes no number, so the adapter is bitwise the plain run's (which saves no checkpoint: saving
    one changes no number either). (peft walks the wrapped modules to pick adapter keys: the final adapter and every
    checkpoint's adapter were once written with 0 tensors.)"""
    plain_run = trained(**TWO_STEPS)
    run_in_process("train", plain_run.config, "--set", f"output_dir={tmp_path / 'ckpt'}", "--set",
                   "train.activation_checkpointing=true", "--set", "train.save_every=1")
    plain = adapter_of(plain_run.run)
    for adapter_dir in (tmp_path / "ckpt", tmp_path / "ckpt" / "checkpoints" / "step-1"):
        saved = adapter_of(adapter_dir)
        assert saved.keys() == plain.keys() and len(saved) > 0
    saved = adapter_of(tmp_path / "ckpt")
    assert all(torch.equal(saved[k], plain[k]) for k in plain)


def test_outputs_load_with_peft_and_transformers_reproduces_eval(tmp_path, trained):
    from peft import PeftModel
    from transformers import Qwen3_5ForCausalLM

    from packtrain.data.jsonl import load_examples

    finished = trained(train={"max_steps": 3, "save_every": 2})
    cfg, run = finished.config, finished.run
    for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "config.yaml", "loss.png",
                 "metrics.jsonl", "base/config.json", "checkpoints/step-2/optimizer.pt",
                 "checkpoints/step-2/scheduler.pt", "checkpoints/step-2/rng-rank-0.pt", "checkpoints/step-2/state.json",
                 "checkpoints/step-2/trainable.safetensors",
                 "checkpoints/step-2/adapter/adapter_model.safetensors"):
        assert (run / name).exists(), name
    metrics = metrics_of(run)
    assert metrics[0]["split"] == "eval" and metrics[0]["step"] == 0  # eval before any update
    train_lines = [m for m in metrics if m.get("split") != "eval"]
    assert [m["step"] for m in train_lines] == [1, 2, 3]
    for key in ("epoch", "loss", "lr", "grad_norm", "examples", "positions", "seconds", "peak_memory_bytes"):
        assert key in train_lines[0], key

    out = tmp_path / "eval_out.jsonl"
    run_in_process("eval", cfg, "--adapter", run / "adapter", "--out", out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    examples = {e.id: e for e in load_examples(cfg.parent / "eval.jsonl")}
    assert sorted(r["id"] for r in rows) == sorted(examples)

    base = Qwen3_5ForCausalLM.from_pretrained(run / "base", dtype=torch.float64)
    model = PeftModel.from_pretrained(base, run / "adapter").eval()
    with torch.no_grad():
        for r in rows:
            ex = examples[r["id"]]
            ids = torch.tensor([list(ex.prefix_ids) + list(ex.item_ids) + list(ex.target_ids)])
            labels = torch.full_like(ids, -100)
            start = len(ex.prefix_ids) + len(ex.item_ids)
            labels[0, start:] = ids[0, start:]
            reference = model(input_ids=ids, labels=labels).loss.item()
            assert r["target_tokens"] == len(ex.target_ids)
            # float64 model, transformers' float32 casts (RMSNorm, chunk rule, logits.float()):
            # see tests/packed/test_parity.py
            assert r["loss"] == pytest.approx(reference, rel=5e-6), r["id"]

    standalone = tmp_path / "eval_standalone.jsonl"
    run_in_process("eval", cfg, "--adapter", run / "adapter", "--out", standalone, "--set", "packing.mode=standalone")
    alone = {json.loads(line)["id"]: json.loads(line)["loss"] for line in standalone.read_text().splitlines()}
    for r in rows:
        assert r["loss"] == pytest.approx(alone[r["id"]], rel=5e-6)


@pytest.mark.process
def test_resume_after_kill_gives_the_uninterrupted_adapter(tmp_path, trained):
    """The suite's proof of resuming after SIGKILL (no handler runs, no final save); the killed run is a process of
    its own (a fork of one rank), the resume runs here (one torch thread in both, as in the uninterrupted run)."""
    straight = trained(**RESUMED)
    cfg = straight.config
    killed = run_ranks(1, "train", cfg, "--set", f"output_dir={tmp_path / 'killed'}",
                       env={"PACKTRAIN_KILL_AFTER_CHECKPOINT": "4"}, check=False)
    assert killed.returncode != 0, "the run was meant to die after the step-4 checkpoint"
    assert not (tmp_path / "killed" / "adapter").exists()
    resumed = run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'killed'}", "--resume")
    assert "continuing from" in resumed.stdout and "step-4" in resumed.stdout
    a, b = adapter_of(straight.run), adapter_of(tmp_path / "killed")
    assert_equal_adapters(a, b)  # bitwise on CPU (dropout RNG restored too)
    steps = [m["step"] for m in metrics_of(tmp_path / "killed") if m.get("split") != "eval"]
    assert steps == sorted(set(steps)) and steps[-1] == len(steps)  # no step logged twice or lost


def test_bad_config_is_one_clear_error(tmp_path):
    cfg = write_config(tmp_path)
    proc = run_in_process("train", cfg, "--set", "optim.lr=-1", "--set", "train.bogus=3", "--set",
                          "packing.mode=ring", check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    for path in ("optim.lr", "train.bogus", "packing.mode"):
        assert path in proc.stderr, proc.stderr


def test_evals_leave_training_alone_and_the_last_step_is_evaluated(tmp_path):
    """One run with eval data against the same run without: identical adapters, so evaluation ran with dropout
    off (on, it would draw from the RNG the training dropout masks come from) and handed back train mode (left
    in eval mode, training would lose its dropout). max_steps ends mid-epoch off the eval_every grid: a final
    eval runs, and the footer names the step its loss is from. Epoch 2 visits the packs in a new order."""
    cfg = write_config(tmp_path, lora={"dropout": 0.3},
                       train={"epochs": 2, "packs_per_step": 1, "eval_every": 4, "max_steps": 9})
    with_eval = run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'eval'}")
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'plain'}", "--set", "data.eval=null")
    a, b = adapter_of(tmp_path / "eval"), adapter_of(tmp_path / "plain")
    assert_equal_adapters(a, b)

    records = metrics_of(tmp_path / "eval")
    evals = [m for m in records if m.get("split") == "eval"]
    assert [m["step"] for m in evals] == [0, 4, 6, 8, 9]  # every 4, the epoch's end (6 packs), the last step
    assert f"-> {evals[-1]['loss']:.4f} at step 9" in with_eval.stdout

    steps = [m for m in records if m.get("split") != "eval"]
    packs = [(m["positions"], m["examples"]) for m in steps]  # one pack per step: its size says which
    assert [m["epoch"] for m in steps] == [0] * 6 + [1] * 3
    assert packs[6:] != packs[:3] and set(packs[6:]) <= set(packs[:6])  # reshuffled, the same packs


def test_a_plain_sgd_run_resumes(tmp_path):
    """SGD without momentum keeps no optimizer state, and torch's loader cannot place an empty one ("Expected
    device to be set"): every such run failed to resume. The resumed adapter is bitwise the uninterrupted one."""
    from cli_helpers import SGD

    cfg = write_config(tmp_path, optim=SGD, data={"eval": None}, train={"max_steps": 3, "save_every": 1})
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'straight'}")
    run_in_process("train", cfg, "--set", "train.max_steps=2")
    resumed = run_in_process("train", cfg, "--set", "train.max_steps=3", "--resume")
    line = next(x for x in resumed.stdout.splitlines() if x.startswith("resume: continuing from"))
    assert "(step 1, written with world size 1, now 1)" in line, line  # the newest checkpoint: step 1
    straight, again = adapter_of(tmp_path / "straight"), adapter_of(tmp_path / "run")
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)


# what the config asks of the data, refused before output_dir exists (it used to hold base/, config.yaml and the run
# marker by then): a cap every tree pack is over, a budget no example fits, a bad skippable error, an eval split
# that does not fit either
REFUSED_BEFORE_WRITING = [
    (["packing.mode=tree", "train.max_positions=10"], "train.max_positions=10: every tree pack is longer"),
    (["train.max_positions=10"], "train.max_positions=10: every pack is longer"),
    (["packing.token_budget=20"], "over packing.token_budget=20; raise the budget"),
    (["packing.token_budget=20", "packing.on_overflow=skip"], "no example fits packing.token_budget=20"),
    (["train.skippable_errors=[NoSuchError]"], "train.skippable_errors: unknown exception class 'NoSuchError'"),
]


@pytest.mark.parametrize("sets, says", REFUSED_BEFORE_WRITING, ids=[" ".join(s) for s, _ in REFUSED_BEFORE_WRITING])
def test_a_refusal_of_the_data_comes_before_output_dir_is_written(tmp_path, sets, says):
    cfg = write_config(tmp_path)
    proc = run_in_process("train", cfg, *(x for s in sets for x in ("--set", s)), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and says in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_eval_of_a_diverged_adapter_writes_no_nan(tmp_path, trained):
    # the JSONL said "loss": NaN (not JSON) with exit 0
    import shutil

    from safetensors.torch import load_file, save_file

    run = trained()
    adapter = tmp_path / "adapter"
    shutil.copytree(run.run / "adapter", adapter)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    name = next(k for k in weights if "lora_B" in k)
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(adapter / "adapter_model.safetensors"))
    out = tmp_path / "losses.jsonl"
    proc = run_in_process("eval", run.config, "--adapter", adapter, "--out", out, check=False)
    assert proc.returncode == 4 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "packtrain eval: eval: 6 of 6 examples of data.eval have a non-finite loss (the first: 'r0-3', nan)" in \
        proc.stderr and f"nothing written to {out}" in proc.stderr, proc.stderr
    assert not out.exists()
