"""packing.mode: tree through the CLI (in this process): a tree of the bundled rulebooks' examples trains the update
their standalone examples train, and `eval` gives their standalone losses."""

from cli_helpers import SGD, assert_tree_trains_as_standalone, write_config


def test_tree_packs_train_and_evaluate_the_standalone_examples(tmp_path):
    cfg = write_config(tmp_path, optim=SGD, data={"eval": None}, train={"epochs": 1, "packs_per_step": 100})
    assert_tree_trains_as_standalone(cfg, tmp_path, 15, "packing.token_budget=1000")
