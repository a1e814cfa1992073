"""packing.mode: tree through the CLI (in this process): a tree of the bundled rulebooks' examples trains the update
their standalone examples train, sharing positions, and `eval` gives their standalone losses; the sharing check
fails on a tree that shares nothing."""

import pytest
from cli_helpers import (
    SGD,
    adapter_of,
    adapter_rel,
    assert_tree_shared,
    assert_tree_trains_as_standalone,
    binary_tree_config,
    run_in_process,
    write_config,
)


def test_tree_packs_train_and_evaluate_the_standalone_examples(tmp_path):
    cfg = write_config(tmp_path, optim=SGD, data={"eval": None}, train={"epochs": 1, "packs_per_step": 100})
    assert_tree_trains_as_standalone(cfg, tmp_path, 15, "packing.token_budget=1000")


def test_a_tree_is_sized_as_a_tree_in_the_memory_report(tmp_path):
    # a 64-leaf tree was "126 continuations" in `plan --memory` (its nodes), targets averaged over nodes, and
    # --gpu-memory asked for packing.max_continuations in nodes, a setting that bounds leaves under tree
    import json

    cfg = binary_tree_config(tmp_path)
    out = run_in_process("plan", cfg, "--memory").stdout
    assert "memory per GPU for the largest pack: 156 positions, 64 continuations, 64 target tokens" in out, out
    mem = json.loads(run_in_process("plan", cfg, "--memory", "--json", "--gpu-memory", "2.16").stdout)["memory"]  # 2 GiB + 5% reserved
    b = mem["budget_search"]
    assert b["continuation_positions"] == 126 / 64 and b["continuation_targets"] == 1.0, b
    # as many leaves as the budget holds, each with its share of the tree's positions
    assert b["continuations"] == int((b["token_budget"] - 30) / (126 / 64)) > 64, b


def test_the_sharing_check_fails_on_a_tree_that_shares_nothing(tmp_path, monkeypatch):
    """assert_tree_shared can fail: with the tree's layout built as if every continuation had its own images (a
    distinct salt each, so no two share a node: flat packs in the tree's form), the run still trains the standalone
    update, but computes every continuation whole, and the check says so."""
    from packtrain.packed import tree

    build_tree = tree.build_tree
    monkeypatch.setattr(tree, "build_tree", lambda paths, salts=None: build_tree(paths, list(range(len(paths)))))
    cfg = write_config(tmp_path, optim=SGD, data={"eval": None}, train={"epochs": 1, "packs_per_step": 100})
    for mode in ("tree", "standalone"):
        run_in_process("train", cfg, "--set", f"output_dir={tmp_path / mode}", "--set", f"packing.mode={mode}")
    assert adapter_rel(adapter_of(tmp_path / "tree"), adapter_of(tmp_path / "standalone")) < 1e-6
    with pytest.raises(AssertionError, match="the tree shared nothing"):
        assert_tree_shared(cfg, tmp_path / "tree")
