"""packing.mode: tree across ranks and runs, through the CLI: 2 ranks train what 1 rank trains (balanced steps over
the tree packs' costs), a stopped and resumed tree run equals the uninterrupted one, a resume under another
packing.mode is refused, and `eval --generate` under tree generates what shared_prefix generates."""

import pytest
import torch
from cli_helpers import adapter_of, run_in_process, run_ranks, train_losses, write_config

# The bundled rulebooks under tree: 6 packs (193, 145, 167, 119, 181 and 140 positions; `packtrain plan`); 3 packs a
# step over 2 ranks, so rank 0 trains 2 packs a step and rank 1 one, and step 3 starts the second epoch
TWO_RANKS = {"data": {"eval": None}, "packing": {"mode": "tree"},
             "train": {"epochs": 2, "max_steps": 3, "packs_per_step": 3}}


@pytest.mark.process
@pytest.mark.distributed
def test_two_ranks_equal_one_rank_under_tree(tmp_path):
    cfg = write_config(tmp_path, **TWO_RANKS)
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'one'}")
    run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'two'}")
    one, two = adapter_of(tmp_path / "one"), adapter_of(tmp_path / "two")
    assert one.keys() == two.keys() and one
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-10, atol=1e-13)
    assert len(train_losses(tmp_path / "one")) == 3
    assert train_losses(tmp_path / "one") == pytest.approx(train_losses(tmp_path / "two"), rel=1e-12)
