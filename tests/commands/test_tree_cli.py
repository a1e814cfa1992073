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


def test_a_tree_dpo_budget_that_fits_each_pairs_tree_plans_and_trains(tmp_path):
    """packing.mode tree, dpo, on_overflow error, the budget the largest pair's tree needs (each pair's two answers
    share P and the item, so flat they need more): plan and train go on (they said `no example fits
    packing.token_budget=N (4 skipped)`, nothing skipped, from the shared_prefix comparison's flat planning); one
    position less is refused naming the pair."""
    from cli_helpers import write_pair_data

    from packtrain.config import load_config
    from packtrain.data.planner import plan_packs, plan_tree_packs
    from packtrain.run.session import open_session

    pairs = write_pair_data(tmp_path / "pairs.jsonl")
    cfg = write_config(tmp_path, data={"train": str(pairs), "eval": None},
                       packing={"mode": "tree", "on_overflow": "error"},
                       train={"objective": "dpo", "max_steps": 1, "dpo_reference": "per_step"})
    examples = open_session(load_config(cfg), None, model=False, savings=False).examples
    alone = plan_tree_packs(examples, 10_000, 2)  # one pair a pack: its tree
    budget = max(pack.positions for pack in alone.packs)
    assert all(len(pack.examples) == 2 for pack in alone.packs)
    with pytest.raises(Exception, match="no example fits"):  # flat, no pair fits the budget
        plan_packs(examples, budget, 2, on_overflow="skip")
    out = run_in_process("plan", cfg, "--set", f"packing.token_budget={budget}")
    assert "no example fits" not in out.stdout + out.stderr
    run_in_process("train", cfg, "--set", f"packing.token_budget={budget}")
    refused = run_in_process("plan", cfg, "--set", f"packing.token_budget={budget - 1}", check=False)
    assert refused.returncode == 2 and "no example fits" not in refused.stderr, refused.stderr
    assert "packing.token_budget" in refused.stderr and "pair" in refused.stderr, refused.stderr
