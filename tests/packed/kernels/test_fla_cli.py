"""The CLI on CPU with fla installed: `TRITON_INTERPRET=1 packtrain train CONFIG --set model.kernels=fla` trains like
the torch kernels (in this process: conftest.py sets the interpreter); standalone training and eval run without the
interpreter (transformers' own kernels routed to torch on CPU; a process of its own, since Triton reads
TRITON_INTERPRET at import). Skipped where fla is not installed."""

import json
import os
import subprocess
import sys

import pytest
import torch
from cli_helpers import REPO, TINY_MODEL, adapter_of, metrics_of, run_in_process, write_config
from fla_interp import needs_interpreter

pytestmark = needs_interpreter

# float32; SGD, so an update is proportional to the gradient and the adapters compare gradients; one GDN layer with
# one key head and two value heads (fewer interpreted programs).
MODEL = {"config": {**TINY_MODEL, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
                    "linear_num_key_heads": 1, "linear_num_value_heads": 2}, "dtype": "float32"}
OPTIM = {"name": "sgd", "lr": 0.5, "warmup_steps": 0}
TRAIN = {"max_steps": 2, "packs_per_step": 1}
# Measured here (two runs): losses (eval and train) agree to <= 1.2e-8 relative, gradient norms to <= 2.8e-7,
# adapters to <= 4.3e-7 of their largest entry (6e-8 absolute). Bounds with ~5-10x headroom, far below what a
# broken plumbing moves (tests/packed/kernels/test_fla_interpreter_model.py: loss >= 5e-2).
LOSS_REL, GRAD_REL, ADAPTER_REL, ADAPTER_ABS = 1e-7, 2e-6, 4e-6, 5e-7


def test_train_with_fla_kernels_under_the_interpreter_matches_torch_kernels(tmp_path):
    cfg = write_config(tmp_path, model=MODEL, optim=OPTIM, train=TRAIN)
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'torch'}", "--set", "model.kernels=torch")
    proc = run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'fla'}", "--set", "model.kernels=fla")
    assert "gated-deltanet=fla (its Triton delta rule, FlashQLA off), attention=batched" in proc.stdout + proc.stderr
    ref, got = metrics_of(tmp_path / "torch"), metrics_of(tmp_path / "fla")
    assert [m.get("split") for m in got] == [m.get("split") for m in ref] and len(ref) >= 3
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_REL), (a, b)
        if "grad_norm" in b:
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRAD_REL), (a, b)
    fla_adapter, torch_adapter = adapter_of(tmp_path / "fla"), adapter_of(tmp_path / "torch")
    assert fla_adapter.keys() == torch_adapter.keys() and fla_adapter
    for name in torch_adapter:
        torch.testing.assert_close(fla_adapter[name], torch_adapter[name], rtol=ADAPTER_REL, atol=ADAPTER_ABS)


@pytest.mark.process
def test_standalone_train_and_eval_run_without_the_interpreter(tmp_path):
    """Unpacked forwards on CPU never reach fla's kernels, which fail there uncompiled ("0 active drivers")."""
    cfg = write_config(tmp_path, model=MODEL, optim=OPTIM, train={"max_steps": 1})
    out = tmp_path / "losses.jsonl"
    # both commands in one process started without the interpreter
    train = ["train", str(cfg), "--set", "packing.mode=standalone"]
    evaluate = ["eval", str(cfg), "--adapter", str(tmp_path / "run" / "adapter"), "--out", str(out), "--set",
                "packing.mode=standalone"]
    script = f"from packtrain.cli import main\nassert main({train!r}) == 0\nraise SystemExit(main({evaluate!r}))\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(r["loss"] > 0 for r in rows)
