"""The walk through the CLI (in this process; two ranks as processes): long examples under a small budget train the
adapter their whole standalone update trains (horizon all), packs and walks mixed in one step; `plan` counts them;
2 ranks == 1 rank."""

import json

import pytest
import torch
from cli_helpers import SGD, adapter_of, adapter_rel, run_in_process, run_ranks, train_losses, write_config

# Budget 90: the five shortest examples (P 31 + 48 to 56) pack, one per pack; the other ten (P 56-57 + 43 to 56)
# walk in chunks of 16 over [P, P + length - 1): 35 chunks.
WALK = {"token_budget": 90, "on_overflow": "walk", "walk": {"chunk": 16, "horizon": "all"}}


def test_walked_examples_train_their_standalone_update(tmp_path):
    cfg = write_config(tmp_path, packing=WALK, optim=SGD, data={"eval": None},
                       train={"epochs": 2, "packs_per_step": 100})
    walked = run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'walk'}")
    said = " ".join(walked.stdout.split())  # the header wraps at 120 columns
    assert "on_overflow walk (chunks of 16 on top of P, horizon all" in said
    assert "10 examples over the budget in 35 chunks" in said
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'standalone'}", "--set", "packing.mode=standalone",
                   "--set", "packing.token_budget=1000")
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'h0'}", "--set", "packing.walk.horizon=0")
    reference = adapter_of(tmp_path / "standalone")
    # float64 except transformers' float32 casts (RMSNorm, gated norm, GDN kernel): measured 1.7e-8
    assert adapter_rel(adapter_of(tmp_path / "walk"), reference) < 1e-6
    assert adapter_rel(adapter_of(tmp_path / "h0"), reference) > 1e-2  # the check can tell a truncated gradient
    for a, b in zip(train_losses(tmp_path / "walk"), train_losses(tmp_path / "standalone")):
        assert abs(a - b) < 1e-7 * abs(b)


def test_plan_counts_walked_examples(tmp_path):
    cfg = write_config(tmp_path, packing=WALK)
    stats = json.loads(run_in_process("plan", cfg, "--json").stdout)
    assert (stats["examples"], stats["walked"], stats["walk_chunks"], stats["packs"]) == (15, 10, 35, 5)
    table = run_in_process("plan", cfg).stdout
    assert "walked     10 examples over the budget, in 35 chunks" in table


@pytest.mark.process
@pytest.mark.distributed
def test_two_ranks_equal_one_rank_with_walks(tmp_path):
    cfg = write_config(tmp_path, packing=WALK, data={"eval": None}, train={"max_steps": 3, "packs_per_step": 3})
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'one'}")
    run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'two'}")
    one, two = adapter_of(tmp_path / "one"), adapter_of(tmp_path / "two")
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-10, atol=1e-13)
    assert train_losses(tmp_path / "one") == pytest.approx(train_losses(tmp_path / "two"), rel=1e-12)
