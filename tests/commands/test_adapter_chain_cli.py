"""``model.adapter: DIR`` through the real CLI, in float64 on the tiny model: DPO started from an SFT run's adapter
is, step for step and bit for bit, DPO on ``model.path`` = that adapter's ``export --merged``; a chain (RL from the
DPO run's adapter) folds base + SFT + DPO; eval and export of such a run fold the start as train did; an adapter of
another base, or a missing one, is refused before the run directory is written."""

import json

import pytest
import torch
import yaml
from cli_helpers import (
    SGD,
    adapter_of,
    assert_equal_adapters,
    refused,
    run_in_process,
    train_losses,
    write_config,
    write_pair_data,
)
from safetensors import safe_open

DPO = {"objective": "dpo", "dpo_beta": 0.5, "max_steps": 2, "packs_per_step": 1}


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """An SFT run on the random tiny base (LoRA and a trained lm_head); its run directory."""
    tmp = tmp_path_factory.mktemp("sft")
    cfg = write_config(tmp, lora={"modules_to_save": ["lm_head"]}, optim=SGD, train={"max_steps": 2},
                       data={"eval": None})
    run_in_process("train", cfg)
    return tmp / "run"


def _run(tmp, name, model, **sections):
    cfg = write_config(tmp, name=f"{name}.yaml", model=model, optim=SGD, output_dir=str(tmp / name), **sections)
    out = run_in_process("train", cfg)
    return tmp / name, out


@pytest.fixture(scope="module")
def dpo(sft, tmp_path_factory):
    """(folder, DPO with model.adapter the SFT adapter, the same DPO on model.path its merged export)."""
    tmp = tmp_path_factory.mktemp("dpo")
    pairs = {"train": str(write_pair_data(tmp / "pairs.jsonl")), "eval": None}
    run_in_process("export", sft, "--merged", tmp / "sft-merged")
    started, out = _run(tmp, "started", {"adapter": str(sft / "adapter")}, data=pairs, train=DPO)
    assert f"model.adapter: the base + {sft / 'adapter'}, folded" in out.stdout
    merged, _ = _run(tmp, "merged", {"path": str(tmp / "sft-merged"), "config": None}, data=pairs, train=DPO)
    return tmp, started, merged


def test_dpo_from_the_sft_adapter_is_dpo_on_its_merged_export(sft, dpo):
    """The acceptance: the per-step losses and the final adapter, bit for bit (the reference, the adapter disabled, is
    the SFT model in both)."""
    _, started, merged = dpo
    losses = train_losses(started)
    assert len(losses) == 2 and losses == train_losses(merged)
    assert_equal_adapters(adapter_of(started), adapter_of(merged))
    assert yaml.safe_load((started / "config.yaml").read_text())["model"]["adapter"] == str(sft / "adapter")
    record = json.loads((started / "adapter" / "packtrain_base.json").read_text())
    assert record["start"]["path"] == str((sft / "adapter").resolve())


def test_a_two_link_chain_folds_sft_then_dpo(dpo):
    """RL from the DPO run's adapter: base + SFT (the DPO adapter's recorded start) + DPO, as its merged export."""
    tmp, started, _ = dpo
    run_in_process("export", started, "--merged", tmp / "dpo-merged")
    text = {"eval": None}
    rl, _ = _run(tmp, "rl", {"adapter": str(started / "adapter")}, data=text, train={"max_steps": 2})
    rl_merged, _ = _run(tmp, "rl-merged", {"path": str(tmp / "dpo-merged"), "config": None}, data=text,
                        train={"max_steps": 2})
    assert train_losses(rl) == train_losses(rl_merged)
    assert_equal_adapters(adapter_of(rl), adapter_of(rl_merged))


def test_eval_of_a_started_run_folds_its_start(dpo):
    tmp, started, merged = dpo
    rows = {}
    for run, adapter in [(started, "adapter"), (merged, "adapter"), (started, "none"), (merged, "none")]:
        out = tmp / f"{run.name}-{adapter}.jsonl"
        run_in_process("eval", run / "config.yaml", "--adapter", run / adapter if adapter != "none" else "none",
                       "--out", out)
        rows[run.name, adapter] = out.read_text()
    assert rows["started", "adapter"] == rows["merged", "adapter"]
    assert rows["started", "none"] == rows["merged", "none"] != rows["started", "adapter"]  # the reference: SFT's


def test_eval_refuses_an_adapter_trained_from_another_start(sft, dpo, tmp_path):
    _, started, _ = dpo
    err = refused(run_in_process("eval", sft / "config.yaml", "--adapter", started / "adapter", "--out",
                                 tmp_path / "e.jsonl", check=False))
    assert f"--adapter: {started / 'adapter'} was trained on top of" in err
    assert "this config has no model.adapter" in err


def _tensors(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"] if \
        (folder / "model.safetensors.index.json").is_file() else None
    files = sorted(set(index.values())) if index else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - a safetensors handle
    return out


def test_the_vllm_export_of_a_started_run_serves_the_start_folded(dpo):
    tmp, started, _ = dpo
    run_in_process("export", started, "--for", "vllm", tmp / "vllm")
    served, sft_merged = _tensors(tmp / "vllm" / "model"), _tensors(tmp / "sft-merged")
    assert served.keys() == sft_merged.keys()
    assert all(torch.equal(served[k], sft_merged[k]) for k in served)


def test_an_adapter_of_another_base_is_refused(sft, tmp_path):
    cfg = write_config(tmp_path, model={"seed": 1, "adapter": str(sft / "adapter")}, data={"eval": None})
    err = refused(run_in_process("train", cfg, check=False))
    assert f"model.adapter: {sft / 'adapter'} was trained on another base, model.config (qwen3_5_text, seed 0)" in err
    assert "not this one, model.config (qwen3_5_text, seed 1)" in err
    assert not (tmp_path / "run").exists()


def test_a_missing_or_damaged_adapter_is_refused_before_the_run_directory(sft, tmp_path):
    no_config = "is not a PEFT adapter directory (no adapter_config.json)"
    for adapter, says in [(tmp_path / "gone", "does not exist"), (sft, no_config)]:
        cfg = write_config(tmp_path, model={"adapter": str(adapter)}, data={"eval": None})
        err = refused(run_in_process("train", cfg, check=False))
        assert f"model.adapter: {adapter} {says}" in err
        assert not (tmp_path / "run").exists()
