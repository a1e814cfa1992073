"""`packtrain bench`: a smoke of the real command (structure of bench.json, equal losses), never its timings; the
FLOP count against the model's own linear layers. The generated data: tests/bench/test_presets.py. The gpu-marked
test runs a shortened gpu preset (tools/gpu_check.sh runs the full one)."""

import json

import pytest
import torch
from cli_helpers import run_in_process, write_config

from packtrain.bench.presets import Shape, generate_examples
from packtrain.packed.kernels import fla_available

VARIANT_KEYS = {"seconds", "cpu_seconds", "positions_per_s", "target_tokens_per_s", "peak_memory_bytes", "final_loss"}


def _bench(tmp_path, *args) -> dict:
    out = tmp_path / "bench"
    proc = run_in_process("bench", *args, "--out", out)
    assert "x shared" in proc.stdout and "goal" not in proc.stdout  # the table, its figures and no verdict on them
    return json.loads((out / "bench.json").read_text())


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_cpu_preset_shortened_writes_every_variant_and_equal_losses(tmp_path, monkeypatch):
    """The README's `packtrain bench --preset cpu`, shortened to one P of 530 tokens (past the CPU's 512-row MLP
    blocks, where its kv_only variant once crashed: issue 28), one repeat, no warm-up (the next test's run has two
    repeats and a warm-up): every variant runs and writes its figures, and the variants that train the same thing
    reach the same loss."""
    from packtrain.bench import variants

    scored = []  # (evaluator, its packing mode or None, the mean loss it returned), in call order

    def packed_or_standalone(lm, plan, examples, kinds, info):
        rows = real_evaluate(lm, plan, examples, kinds, info)
        scored.append(("evaluate", kinds.mode, variants.mean_loss(rows)))
        return rows

    def plain(model, work):
        loss = real_plain(model, work)
        scored.append(("plain_mean_loss", None, loss))
        return loss

    real_evaluate, real_plain = variants.evaluate, variants.plain_mean_loss
    monkeypatch.setattr(variants, "evaluate", packed_or_standalone)
    monkeypatch.setattr(variants, "plain_mean_loss", plain)
    result = _bench(tmp_path, "--preset", "cpu", "--prefix-tokens", "530", "--continuations", "2", "--cont-tokens",
                    "2:3", "--repeats", "1", "--no-warmup")
    assert result["preset"] == "cpu" and result["plan"]["positions_packed"] > 512
    assert (tmp_path / "bench" / "bench.png").stat().st_size > 0
    assert set(result["variants"]) == {"shared_prefix", "kv_only", "frozen", "standalone", "plain"}
    for name, v in result["variants"].items():
        assert VARIANT_KEYS <= v.keys() and v["error"] is None, name
        assert len(v["seconds_per_repeat"]) == result["repeats"] == 1
    plan = result["plan"]
    assert result["position_ratio"] == plan["positions_standalone"] / plan["positions_packed"] > 1
    assert result["variants"]["shared_prefix"]["positions"] == plan["positions_packed"]
    assert result["variants"]["plain"]["lm_head_rows"] == plan["positions_standalone"]
    # One float32 training step from the same adapter, then each variant evaluates its adapter through its own
    # forward (packed, standalone, transformers' with labels): equal losses to float32 rounding (packed vs
    # standalone forwards agree to ~3e-7, docs/design.md). Before, one evaluator scored all three. Which one scored
    # each variant is read off the calls, not off unequal losses: two independent float32 computations over a few
    # tokens can round alike (shared_prefix and plain did, bitwise, on an AVX-only CPU).
    v = result["variants"]
    order = list(variants.DEFAULT_VARIANTS)  # the order of the one repeat: --variants' default
    assert len(scored) == len(order)
    expected = {"plain": ("plain_mean_loss", None), "standalone": ("evaluate", "standalone")}
    for name, (evaluator, mode, loss) in zip(order, scored):
        assert (evaluator, mode) == expected.get(name, ("evaluate", "shared_prefix")), name
        assert v[name]["final_loss"] == loss, name
    for name in ("standalone", "plain"):
        assert _rel(v["shared_prefix"]["final_loss"], v[name]["final_loss"]) < 1e-5, name
        assert v["shared_prefix"]["step_losses"][0] == pytest.approx(v[name]["step_losses"][0], rel=1e-5), name
    # the context modes: the same first forward (kv_only bitwise, frozen to float32 rounding), another update
    steps = {name: v["step_losses"][0] for name, v in result["variants"].items()}
    assert steps["kv_only"] == steps["shared_prefix"]
    assert _rel(steps["frozen"], steps["shared_prefix"]) < 1e-5
    for mode in ("kv_only", "frozen"):
        assert result["variants"][mode]["final_loss"] != result["variants"]["shared_prefix"]["final_loss"], mode


def test_config_file_and_its_data(tmp_path):
    """A config file's model and data, the three variants that train the same thing, two interleaved repeats after a
    warm-up."""
    cfg = write_config(tmp_path, model={"dtype": "float32"}, optim={"warmup_steps": 0})
    result = _bench(tmp_path, str(cfg), "--repeats", "2", "--variants", "shared_prefix,standalone,plain")
    assert result["config"] == str(cfg) and result["data"].endswith("train.jsonl")
    assert set(result["variants"]) == {"shared_prefix", "standalone", "plain"}
    for name, v in result["variants"].items():
        assert v["error"] is None and len(v["seconds_per_repeat"]) == result["repeats"] == 2, name
    assert result["plan"]["examples"] == 15 and result["steps_per_epoch"] == 3  # 3 rulebooks x 5, packs of 3
    losses = {name: v["final_loss"] for name, v in result["variants"].items()}
    assert _rel(losses["shared_prefix"], losses["standalone"]) < 1e-5
    assert _rel(losses["shared_prefix"], losses["plain"]) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not fla_available(), reason="needs CUDA and fla")
def test_gpu_preset_shortened(tmp_path):
    result = _bench(tmp_path, "--preset", "gpu", "--prefix-tokens", "4096", "--continuations", "4",
                    "--cont-tokens", "256:512", "--repeats", "1")
    assert result["machine"]["cuda"] and result["peak_tflops"] == 989.0
    for name, v in result["variants"].items():
        assert v["error"] is None and 0 < v["mfu"] < 1, name
    losses = {name: v["final_loss"] for name, v in result["variants"].items()}
    assert _rel(losses["shared_prefix"], losses["standalone"]) < 3e-2  # bf16 (tests/packed/kernels/test_gpu.py's bound)


def test_the_shared_prefix_variant_trains_the_steps_train_trains(tmp_path):
    """`packtrain bench --preset cpu --variants shared_prefix` runs the trainer's step on the trainer's steps: its
    per-step losses are `packtrain train`'s on the config and data it writes beside its results. Packs of three
    prompts and several sizes, two per step, so that balanced steps (train.balance: cost) are not round robin's."""
    out = tmp_path / "bench"
    bench = run_in_process("bench", "--preset", "cpu", "--variants", "shared_prefix", "--prompts", "3",
                           "--prefix-tokens", "24", "--continuations", "5", "--cont-tokens", "4:40", "--repeats", "1",
                           "--no-warmup",
                           "--set", "packing.token_budget=90", "--set", "train.packs_per_step=2",
                           "--set", "model.config.hidden_size=64", "--set", "model.config.intermediate_size=96",
                           "--set", "model.config.head_dim=16", "--set", "model.config.linear_key_head_dim=16",
                           "--set", "model.config.linear_value_head_dim=16", "--out", out)
    assert bench.returncode == 0, bench.stderr
    result = json.loads((out / "bench.json").read_text())
    config = out / "config.yaml"
    assert f"the same run: packtrain train {config}" in bench.stdout
    bench_losses = result["variants"]["shared_prefix"]["step_losses"]
    proc = run_in_process("train", config, "--set", f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_losses = [x["loss"] for x in lines if "split" not in x]
    assert result["steps_per_epoch"] >= 3 and len(train_losses) == result["steps_per_epoch"]
    assert bench_losses == train_losses


def test_tree_preset_shortened_counts_the_trees_positions_and_trains_the_same_update(tmp_path):
    """`packtrain bench --preset tree`, shortened: the tree variant's positions are P once per tree pack plus the
    distinct prefixes of the continuations (counted here from the generated examples, a set of tuples), and with the
    preset's one step per epoch tree, shared_prefix and standalone make the same update (equal losses) although
    shared_prefix needs more packs (a budget of 100 positions) than the tree."""
    args = ["--prefix-tokens", "40", "--continuations", "2", "--cont-tokens", "4:6", "--turns", "3:4",
            "--set", "packing.token_budget=100"]
    result = _bench(tmp_path, "--preset", "tree", *args, "--repeats", "1", "--no-warmup")
    assert set(result["variants"]) == {"tree", "shared_prefix", "standalone"}
    examples = generate_examples(Shape(1, 40, 2, (4, 6), turns=(3, 4)), vocab=1024)
    prefixes = {tuple(ex.item_ids + ex.target_ids)[:k] for ex in examples
                for k in range(1, len(ex.item_ids) + len(ex.target_ids) + 1)}
    tree = result["plan"]["tree"]
    assert tree["packs"] == 1 and result["steps_per_epoch"] == 1
    assert result["variants"]["tree"]["positions"] == tree["positions_packed"] == 40 + len(prefixes)
    flat = result["plan"]
    assert flat["packs"] >= 2
    assert flat["positions_packed"] == 40 * flat["packs"] + sum(ex.len_continuation for ex in examples)
    v = result["variants"]
    for name in ("tree", "standalone"):
        assert v[name]["error"] is None, name
        assert _rel(v[name]["final_loss"], v["shared_prefix"]["final_loss"]) < 1e-5, name
        assert v[name]["step_losses"][0] == pytest.approx(v["shared_prefix"]["step_losses"][0], rel=1e-5), name


def test_dpo_preset_shortened_compares_tree_shared_prefix_and_standalone_pairs(tmp_path):
    """`packtrain bench --preset dpo`, shortened: preference pairs sharing P and the item, the three variants on the
    same update (equal final losses), the tree's positions below shared_prefix's below standalone's (P once, then each
    pair's item once), and the tree-vs-standalone figure in bench.json and the table."""
    out = tmp_path / "bench"
    proc = run_in_process("bench", "--preset", "dpo", "--prefix-tokens", "48", "--continuations", "2",
                          "--cont-tokens", "8:10", "--repeats", "1", "--no-warmup", "--out", out)
    result = json.loads((out / "bench.json").read_text())
    v = result["variants"]
    assert list(v) == ["tree", "shared_prefix", "standalone"] and result["plan"]["examples"] == 4
    items = [len(ex["item_ids"]) for ex in map(json.loads, (out / "train.jsonl").read_text().splitlines())]
    assert v["standalone"]["positions"] == result["plan"]["positions_standalone"]
    assert v["tree"]["positions"] == v["shared_prefix"]["positions"] - sum(items)  # each pair's item once
    assert max(_rel(v[n]["final_loss"], v["shared_prefix"]["final_loss"]) for n in v) < 1e-5
    pairs = result["tree_vs_standalone"]["seconds"]
    assert pairs["speedup"] == pytest.approx(v["standalone"]["seconds"] / v["tree"]["seconds"])
    assert pairs["position_ratio"] == v["standalone"]["positions"] / v["tree"]["positions"]
    assert "tree vs standalone pairs (wall): " in proc.stdout and "goal" not in proc.stdout
    assert {"prefix_ids", "item_ids", "chosen_ids", "rejected_ids"} <= set(json.loads(
        (out / "train.jsonl").read_text().splitlines()[0]))  # `packtrain train DIR/config.yaml` trains the pairs


def test_rl_preset_shortened_compares_tree_shared_prefix_and_standalone_completions(tmp_path):
    """`packtrain bench --preset rl`, shortened: scored groups of 8 completions sharing P and their item, the three
    variants on the same GRPO update (equal final losses), the tree's positions below shared_prefix's below
    standalone's (each item once, not once per completion), the tree-vs-standalone figure in bench.json and the
    table, and DIR/train.jsonl in the scored-group format that `packtrain train DIR/config.yaml` reads."""
    out = tmp_path / "bench"
    proc = run_in_process("bench", "--preset", "rl", "--prefix-tokens", "48", "--continuations", "2",
                          "--cont-tokens", "8:10", "--repeats", "1", "--no-warmup", "--out", out)
    result = json.loads((out / "bench.json").read_text())
    v = result["variants"]
    assert list(v) == ["tree", "shared_prefix", "standalone"] and result["plan"]["examples"] == 16
    groups = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(groups) == 2 and all(len(g["completion_ids"]) == 8 and len(set(g["rewards"])) == 2 for g in groups)
    assert v["standalone"]["positions"] == result["plan"]["positions_standalone"]
    assert v["tree"]["positions"] <= v["shared_prefix"]["positions"] - 7 * sum(len(g["item_ids"]) for g in groups)
    assert max(_rel(v[n]["final_loss"], v["shared_prefix"]["final_loss"]) for n in v) < 1e-5
    versus = result["tree_vs_standalone"]["seconds"]
    assert versus["position_ratio"] == v["standalone"]["positions"] / v["tree"]["positions"] > 2
    assert "tree vs standalone completions (wall): " in proc.stdout
