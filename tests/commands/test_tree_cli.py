"""packing.mode: tree through the CLI (in this process): a tree of the bundled rulebooks' examples trains the update
their standalone examples train, and `eval` gives their standalone losses."""

from cli_helpers import SGD, assert_tree_trains_as_standalone, binary_tree_config, write_config


def test_tree_packs_train_and_evaluate_the_standalone_examples(tmp_path):
    cfg = write_config(tmp_path, optim=SGD, data={"eval": None}, train={"epochs": 1, "packs_per_step": 100})
    assert_tree_trains_as_standalone(cfg, tmp_path, 15, "packing.token_budget=1000")


def test_a_tree_is_sized_as_a_tree_in_the_memory_report(tmp_path):
    # a 64-leaf tree was "126 continuations" in `plan --memory` (its nodes), targets averaged over nodes, and
    # --gpu-memory asked for packing.max_continuations in nodes, a setting that bounds leaves under tree
    import json

    from cli_helpers import run_in_process

    cfg = binary_tree_config(tmp_path)
    out = run_in_process("plan", cfg, "--memory").stdout
    assert "memory per GPU for the largest pack: 156 positions, 64 continuations, 64 target tokens" in out, out
    mem = json.loads(run_in_process("plan", cfg, "--memory", "--json", "--gpu-memory", "2.16").stdout)["memory"]  # 2 GiB + 5% reserved
    b = mem["budget_search"]
    assert b["continuation_positions"] == 126 / 64 and b["continuation_targets"] == 1.0, b
    # as many leaves as the budget holds, each with its share of the tree's positions
    assert b["continuations"] == int((b["token_budget"] - 30) / (126 / 64)) > 64, b
