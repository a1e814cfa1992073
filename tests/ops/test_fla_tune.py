"""Pinned FLA autotune: the files pretune-fla writes and check-nodes reads, from synthetic autotuner results (CPU);
the real run on a GPU (skipped without CUDA and fla)."""

import json
from types import SimpleNamespace

import pytest
import torch
from cli_helpers import run_cli, run_in_process, write_config

from packtrain.ops import fla_tune
from packtrain.packed.kernels import fla_available


def _triton_config(bt, warps, stages=2):
    return SimpleNamespace(kwargs={"BT": bt}, num_warps=warps, num_stages=stages, num_ctas=1, maxnreg=None)


def _tuned():
    """What Triton's autotuners hold after a run: kernel -> {tuning key: winning Config}."""
    return {
        "l2norm_bwd_kernel": {(128, 1, "torch.bfloat16"): _triton_config(32, 4)},
        "chunk_fwd_kernel_o": {(48, 128, 128, 64, "torch.bfloat16"): _triton_config(64, 8, 3),
                               (48, 128, 128, 64, "torch.float32"): _triton_config(64, 8, 3),
                               (16, 128, 128, 64, "torch.bfloat16"): _triton_config(32, 4, 2)},
    }


def _entries(tuned):
    return {k: {key: fla_tune.entry_from_triton(c) for key, c in v.items()} for k, v in tuned.items()}


def test_files_have_fla_format_and_read_back(tmp_path):
    written = fla_tune.write_fla_configs(tmp_path, _entries(_tuned()), "NVIDIA H200", "3.6.0")
    assert sorted(p.name for p in written) == ["chunk_fwd_kernel_o.json", "l2norm_bwd_kernel.json"]
    data = json.loads((tmp_path / "l2norm_bwd_kernel.json").read_text())
    # the fields fla's KernelConfigFile reads; mode `default` uses default_config alone
    assert data["kernel_name"] == "l2norm_bwd_kernel" and data["triton_version"] == "3.6.0"
    assert data["autotune_entries"] == {}
    assert data["default_config"] == {"kwargs": {"BT": 32}, "num_warps": 4, "num_stages": 2, "num_ctas": 1}
    assert data["packtrain"] == {"gpu": "NVIDIA H200", "tuned_keys": [[128, 1, "torch.bfloat16"]],
                                 "chosen_key": [128, 1, "torch.bfloat16"]}
    assert fla_tune.read_fla_configs(tmp_path) == {
        "chunk_fwd_kernel_o": {"kwargs": {"BT": 64}, "num_warps": 8, "num_stages": 3, "num_ctas": 1},
        "l2norm_bwd_kernel": {"kwargs": {"BT": 32}, "num_warps": 4, "num_stages": 2, "num_ctas": 1},
    }


def test_several_keys_pin_the_winner_most_keys_agree_on():
    key, entry = fla_tune.choose_default(_entries(_tuned())["chunk_fwd_kernel_o"])
    assert entry["kwargs"] == {"BT": 64} and entry["num_warps"] == 8
    assert key == (48, 128, 128, 64, "torch.float32")  # a tie between equal winners: the largest key


def test_a_tie_between_winners_goes_to_the_largest_key():
    tuned = {(128, 1): fla_tune.config_entry({"BT": 16}, 2, 2), (128, 2): fla_tune.config_entry({"BT": 64}, 4, 2)}
    assert fla_tune.choose_default(tuned) == ((128, 2), fla_tune.config_entry({"BT": 64}, 4, 2))


def test_maxnreg_is_kept_when_triton_set_it():
    cfg = SimpleNamespace(kwargs={}, num_warps=4, num_stages=1, num_ctas=1, maxnreg=128)
    assert fla_tune.entry_from_triton(cfg)["maxnreg"] == 128


def test_a_file_fla_would_ignore_is_an_error_naming_it(tmp_path):
    (tmp_path / "bad_kernel.json").write_text(json.dumps({"default_config": {"kwargs": {}}}))
    with pytest.raises(fla_tune.FlaConfigError, match="bad_kernel.json"):
        fla_tune.read_fla_configs(tmp_path)
    (tmp_path / "bad_kernel.json").write_text("{not json")
    with pytest.raises(fla_tune.FlaConfigError, match="bad_kernel.json: not valid JSON"):
        fla_tune.read_fla_configs(tmp_path)


def test_missing_folder_reads_as_no_configs(tmp_path):
    assert fla_tune.read_fla_configs(tmp_path / "absent") == {}


def test_digest_follows_the_pinned_configs():
    a = _entries(_tuned())
    configs = {k: fla_tune.choose_default(v)[1] for k, v in a.items()}
    changed = {**configs, "l2norm_bwd_kernel": {**configs["l2norm_bwd_kernel"], "num_warps": 8}}
    assert fla_tune.configs_digest(configs) == fla_tune.configs_digest(dict(reversed(configs.items())))
    assert fla_tune.configs_digest(configs) != fla_tune.configs_digest(changed)


def test_launch_env(tmp_path):
    assert fla_tune.launch_env(tmp_path) == f"FLA_CACHE_MODE=default FLA_CONFIG_DIR={tmp_path.resolve()}"


@pytest.mark.skipif(torch.cuda.is_available() and fla_available(), reason="the CPU refusal")
def test_pretune_on_cpu_is_a_clear_error(tmp_path):
    proc = run_in_process("pretune-fla", write_config(tmp_path), check=False)
    assert proc.returncode == 2
    assert "pretune-fla needs a CUDA GPU and the fla package" in proc.stderr


@pytest.mark.gpu
@pytest.mark.process  # check-nodes in a fresh process: fla reads FLA_CACHE_MODE when it is imported
@pytest.mark.skipif(not torch.cuda.is_available() or not fla_available(), reason="needs CUDA and fla")
def test_pretune_pins_what_triton_tuned_and_check_nodes_sees_it(tmp_path, monkeypatch):
    cfg = write_config(tmp_path, model={"dtype": "bfloat16", "kernels": "fla"}, train={"device": "cuda"})
    out = tmp_path / "fla"
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)  # pretune must search
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    proc = run_cli("pretune-fla", str(cfg), "--prompt-tokens", "32", "--out", str(out))
    pinned = fla_tune.read_fla_configs(out)
    assert "l2norm_fwd_kernel" in pinned, proc.stdout  # the length-bucketed kernel the seed's run tuned
    assert fla_tune.launch_env(out) in proc.stdout
    seen = run_cli("check-nodes", str(cfg), env={"FLA_CACHE_MODE": "default", "FLA_CONFIG_DIR": str(out)}).stdout
    assert f"digest {fla_tune.configs_digest(pinned)}" in seen
