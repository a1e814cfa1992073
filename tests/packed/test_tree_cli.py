"""packing.mode: tree through the CLI (in this process): a tree of the bundled rulebooks' examples trains the update
their standalone examples train, and `eval` gives their standalone losses."""

import json

from cli_helpers import SGD, adapter_of, adapter_rel, run_in_process, train_losses, write_config


def test_tree_packs_train_and_evaluate_the_standalone_examples(tmp_path):
    cfg = write_config(tmp_path, optim=SGD, data={"eval": None}, train={"epochs": 1, "packs_per_step": 100})
    tree = run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'tree'}", "--set", "packing.mode=tree")
    assert "mode tree" in tree.stdout
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'alone'}", "--set", "packing.mode=standalone",
                   "--set", "packing.token_budget=1000")
    # float64 except transformers' float32 casts (RMSNorm, gated norm, GDN gate): measured 1.4e-8
    assert adapter_rel(adapter_of(tmp_path / "tree"), adapter_of(tmp_path / "alone")) < 1e-6
    (a,), (b,) = train_losses(tmp_path / "tree"), train_losses(tmp_path / "alone")
    assert abs(a - b) < 1e-9 * abs(b)
    rows = {}
    for mode in ("tree", "standalone"):
        out = tmp_path / f"{mode}.jsonl"
        run_in_process("eval", cfg, "--adapter", tmp_path / "tree" / "adapter", "--out", out,
                       "--set", f"packing.mode={mode}", "--set", "packing.token_budget=1000")
        rows[mode] = {r["id"]: r["loss"] for r in map(json.loads, out.read_text().splitlines())}
    assert rows["tree"].keys() == rows["standalone"].keys() and len(rows["tree"]) == 15
    assert all(abs(rows["tree"][k] - v) < 1e-9 * abs(v) for k, v in rows["standalone"].items())
