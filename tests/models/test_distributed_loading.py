"""model.path under FSDP: each rank's peak resident memory while loading a multi-shard checkpoint (its ru_maxrss
as it exits), and the 2-rank adapter against the 1-rank one (trained in this process). The ranks are processes
forked from one server (cli_helpers.run_ranks): each starts from the same resident set, which the tiny run's peak
takes away."""

import pytest
import torch
from checkpoints import checkpoint_bytes, save_checkpoint, text_config
from cli_helpers import adapter_of, run_in_process, run_ranks, write_config

pytestmark = [pytest.mark.distributed, pytest.mark.process]

# Build the model as `packtrain train` does (meta device, LoRA, patch, checkpointing, FSDP, fill), then exit
# printing the process's peak resident set (KiB).
LOAD_ONLY = """
import resource, sys, torch
from packtrain.config import load_config
from packtrain.distributed import init_distributed, shutdown
from packtrain.models.build import build_base_model
from packtrain.models.wrap import assemble
cfg = load_config(sys.argv[1])
info = init_distributed("cpu")
_, lm, _ = assemble(build_base_model(cfg, meta=True), cfg, info.device, shard=info.enabled)
print(lm.load_report.describe())
shutdown()
print(f"peak KiB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", flush=True)
"""


def _peak_rank_bytes(tmp_path, nproc, model_dir, name):
    """The largest peak resident set over the ranks, in bytes."""
    cfg = write_config(tmp_path, name=f"{name}.yaml", data={"eval": None},
                       model={"path": str(model_dir), "config": None, "dtype": "float32"},
                       train={"activation_checkpointing": True, "offload": False, "loss_chunk_rows": 0,
                              "mlp_chunk_rows": 0, "norm_chunk_rows": 0})  # the savings as a run would choose them
    proc = run_ranks(nproc, cfg, script=LOAD_ONLY, timeout=300)
    assert f"each of {nproc} ranks reading its shards" in proc.stdout
    peaks = [int(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("peak KiB ")]
    assert len(peaks) == nproc, proc.stdout
    return max(peaks) * 1024


def test_two_ranks_each_hold_about_half_of_the_checkpoint_while_loading(tmp_path):
    """Peak per rank above the same run on a tiny checkpoint: <= 0.6 x the checkpoint (measured 0.53-0.54; reading
    the whole checkpoint on every rank, as from_pretrained does, is >= 1.0 and measured 2.4 before)."""
    wide = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=16, head_dim=64,
                num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8,
                linear_key_head_dim=64, linear_value_head_dim=64,
                layer_types=["linear_attention", "full_attention"] * 8)
    big = save_checkpoint(tmp_path / "big", text_config(**wide), shard_kb=20_000, mtp=True)
    tiny = save_checkpoint(tmp_path / "tiny", text_config(), shard_kb=20)
    size = checkpoint_bytes(big)
    assert size > 150 * 2**20 and len(list(big.glob("*.safetensors"))) >= 8
    peak_big, peak_tiny = _peak_rank_bytes(tmp_path, 2, big, "big"), _peak_rank_bytes(tmp_path, 2, tiny, "tiny")
    above = peak_big - peak_tiny
    print(f"checkpoint {size / 2**20:.0f} MiB; peak per rank {peak_big / 2**20:.0f} MiB, tiny run "
          f"{peak_tiny / 2**20:.0f} MiB: {above / 2**20:.0f} MiB above, {above / size:.3f} of the checkpoint")
    assert above <= 0.6 * size, f"peak per rank {above / 2**20:.0f} MiB above a tiny run, checkpoint {size / 2**20:.0f}"


def test_two_ranks_equal_one_rank_from_a_checkpoint(tmp_path):
    """The LoRA init is seeded and the shards are filled from the checkpoint: one adapter whatever the world
    size (float64: only the order of the cross-rank sums differs)."""
    ckpt = save_checkpoint(tmp_path / "ckpt", text_config())
    cfg = write_config(tmp_path, model={"path": str(ckpt), "config": None, "dtype": "float64"},
                       lora={"init_lora_weights": True}, train={"max_steps": 2, "packs_per_step": 2},
                       data={"eval": None})
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'one'}")
    two = run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'two'}")
    assert "each of 2 ranks reading its shards; not loaded by the model class: mtp.*: 3" in two.stdout
    a = adapter_of(tmp_path / "one")
    b = adapter_of(tmp_path / "two")
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-10, atol=1e-13)
