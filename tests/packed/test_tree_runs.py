"""packing.mode: tree across ranks and runs, through the CLI: 2 ranks train what 1 rank trains (balanced steps over
the tree packs' costs), a stopped and resumed tree run equals the uninterrupted one, a resume under another
packing.mode is refused, and `eval --generate` under tree decodes the tree plan's packs and generates what
transformers' own generate does."""

import functools
import json

import pytest
import torch
from cli_helpers import (
    REPO,
    RESUMED,
    adapter_of,
    assert_equal_adapters,
    metrics_of,
    refused,
    run_in_process,
    run_ranks,
    train_losses,
    write_config,
)

from packtrain.exits import PREEMPTED_EXIT
from packtrain.faults import SIGTERM_IN_STEP
from packtrain.rundir.checkpoint import checkpoints

# The bundled rulebooks under tree: 6 packs (193, 145, 167, 119, 181 and 140 positions; `packtrain plan`); 3 packs a
# step over 2 ranks, so rank 0 trains 2 packs a step and rank 1 one, and step 3 starts the second epoch
TWO_RANKS = {"data": {"eval": None}, "packing": {"mode": "tree"},
             "train": {"epochs": 2, "max_steps": 3, "packs_per_step": 3}}


@pytest.mark.process
@pytest.mark.parametrize("config", ["demo.yaml", "dpo_demo.yaml"])
def test_a_tree_run_at_two_threads_is_the_same_run_every_time(tmp_path, config):
    """Tree SFT (the demo under packing.mode tree) and tree DPO (the DPO demo) in processes of two torch threads, in
    float32: two uninterrupted runs, and one stopped by SIGTERM in step 2 and resumed, train the same adapter bit
    for bit (each computed steps 1-2 on its own). The tree's buckets read P's keys once per run of nodes; summed by
    advanced indexing's backward, in parallel, two runs of one config differed from step 1's gradient on."""
    sets = [f"--set={s}" for s in ("train.max_steps=3", "train.save_every=1", "data.eval=null", "generate.every=null",
                                   "packing.mode=tree", "train.dpo_reference=per_step")]  # per_step: sft ignores it
    straight, run = tmp_path / "straight", tmp_path / "run"
    # each run a fresh process forked from the suite's rank server at two torch threads (cli_helpers.start_ranks:
    # its OpenMP threads wait passively, as spinning ones on the suite's two busy cores took 3x the time; the
    # threads still add in parallel: the runs before the fix differed so too)
    args = ["train", str(REPO / "configs" / config), *sets]
    alone = functools.partial(run_ranks, 1, threads=2)
    alone(*args, "--set", f"output_dir={straight}")
    alone(*args, "--set", f"output_dir={tmp_path / 'again'}")  # a second uninterrupted run
    assert_equal_adapters(adapter_of(straight), adapter_of(tmp_path / "again"))
    stopped = alone(*args, "--set", f"output_dir={run}", env={SIGTERM_IN_STEP: "2"}, check=False)
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-3000:]
    alone(*args, "--set", f"output_dir={run}", "--resume")
    assert_equal_adapters(adapter_of(straight), adapter_of(run))
    assert len(train_losses(run)) == 3 and train_losses(run) == train_losses(straight)


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


def test_a_stopped_tree_run_resumes_to_the_uninterrupted_run_and_refuses_another_mode(tmp_path):
    """SIGTERM during step 3 (in this process): the run stops with step 3's checkpoint. A resume under
    packing.mode shared_prefix is refused (packing is a trajectory key; its packs are other packs); the resume under
    tree trains the uninterrupted run's adapter bit for bit (dropout and a cosine schedule: the RNG and the
    scheduler restored)."""
    cfg = write_config(tmp_path, **{**RESUMED, "data": {"eval": None}, "packing": {"mode": "tree"},
                                    "train": {**RESUMED["train"], "max_steps": 4}})
    straight, run = tmp_path / "straight", tmp_path / "run"
    run_in_process("train", cfg, "--set", f"output_dir={straight}")
    stopped = run_in_process("train", cfg, env={SIGTERM_IN_STEP: "3"}, check=False)
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-3000:]
    assert [p.name for p in checkpoints(run)] == ["step-3", "step-2"]

    err = refused(run_in_process("train", cfg, "--resume", "--set", "packing.mode=shared_prefix", check=False))
    assert "resume refused" in err and "packing.mode: 'tree' -> 'shared_prefix'" in err, err
    # the other packs are the mode's, not edited data: the data line says so
    assert "the packing settings above make other packs" in err and "training data: the tokens" not in err, err

    resumed = run_in_process("train", cfg, "--resume")
    assert "continuing from" in resumed.stdout and "step-3" in resumed.stdout
    assert_equal_adapters(adapter_of(straight), adapter_of(run))
    steps = [m["step"] for m in metrics_of(run) if m.get("split") != "eval"]
    assert steps == [1, 2, 3, 4] and train_losses(run) == train_losses(straight)


def test_eval_generate_under_tree_decodes_the_tree_packs_as_transformers_generates(tmp_path, monkeypatch):
    """Generation keeps sharing P only: under tree it decodes the tree plan's packs' items (other packs than
    shared_prefix's on the training data: (5, 9, 7), (6, 8), ... against (9, 8), (7, 5, 6), ...), and each row's
    greedy tokens are its own, whatever pack it is in: transformers' own ``generate`` on ``concat(P, item)``."""
    from packtrain.config import load_config
    from packtrain.data.jsonl import load_split, load_tokenizer
    from packtrain.models.build import build_base_model
    from packtrain.run import task
    from packtrain.run.units import plan_for

    decoded = []
    generate = task.generate
    monkeypatch.setattr(task, "generate", lambda lm, plan, *a, **k: decoded.append(plan) or generate(lm, plan, *a, **k))
    cfg = write_config(tmp_path, data={"eval": None}, generate={"max_new_tokens": 4})
    out = tmp_path / "tree.jsonl"
    printed = run_in_process("eval", cfg, "--adapter", "none", "--generate", "--out", out,
                             "--set", "packing.mode=tree").stdout
    assert "15 examples of data.train in 3 prompt groups" in printed
    packs = {mode: [p.examples for p in plan_for(load_config(cfg, [f"packing.mode={mode}"]), examples).packs]
             for mode in ("tree", "shared_prefix") for examples in [load_split(load_config(cfg), "train")]}
    assert [[p.examples for p in plan.packs] for plan in decoded] == [packs["tree"]] != [packs["shared_prefix"]]

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    config = load_config(cfg)
    examples = load_split(config, "train")
    assert [r["id"] for r in rows] == [ex.id for ex in examples]
    im_end = load_tokenizer(None).convert_tokens_to_ids("<|im_end|>")
    model = build_base_model(config).eval()
    for ex, row in zip(examples, rows):
        ids = torch.tensor([list(ex.prefix_ids) + list(ex.item_ids)])
        with torch.no_grad():
            new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                 do_sample=False, eos_token_id=[im_end], pad_token_id=0)[0, ids.shape[1]:].tolist()
        new = new[:new.index(im_end)] if im_end in new else new
        assert row["prediction_ids"] == new, (ex.id, row, new)
