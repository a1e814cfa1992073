"""Online GRPO (``rl.num_generations``) through the real CLI: each step samples K completions per request, scores
them with ``generate.metric`` and trains on them as a tree; its groups go to OUTPUT/rollouts/step-N.jsonl.

What is checked, each against something the online path does not compute itself:
- the rollouts: K completions per request of the step, each within ``rl.max_completion_length``; each reward is the
  scorer's on the completion decoded here against the request's target as the data file gives it;
- a replay: ``packtrain train`` on step 1's file (the offline pretokenized format) from the same start makes the
  online step's update (the online step is on-policy, as a file without logprobs is);
- a resume continues bit for bit: the same samples, the same adapter, as the run that never stopped;
- 2 ranks sample the same groups and make the 1-rank update.
"""

import json
import shutil

import pytest
from cli_helpers import (
    REPO,
    TINY_MODEL,
    adapter_of,
    adapter_rel,
    assert_equal_adapters,
    metrics_of,
    refused,
    run_in_process,
    run_ranks,
    write_config,
)

from packtrain.data.jsonl import load_examples, load_tokenizer
from packtrain.exits import Preempted
from packtrain.faults import SIGTERM_IN_STEP

K, LENGTH = 4, 6
SCORER = "def score(prediction, target, example):\n    return (len(prediction) + len(target)) % 4 / 3\n"


def _score(prediction: str, target: str) -> float:
    return (len(prediction) + len(target)) % 4 / 3


def online_config(tmp, name="cfg.yaml", **sections):
    (tmp / "online_len_scorer.py").write_text(SCORER)
    parts = {"packing": {"mode": "tree", "max_continuations": 8},
             "train": {"objective": "grpo", "epochs": 1, "packs_per_step": 1, "seed": 3, "save_every": 100},
             "rl": {"num_generations": K, "max_completion_length": LENGTH, "temperature": 1.3, "top_p": 0.95,
                    "beta": 0.04},
             "generate": {"metric": "python:online_len_scorer:score"},
             "optim": {"name": "adamw", "lr": 1.0e-2, "warmup_steps": 0},
             "data": {"eval": None}}
    for section, values in sections.items():
        parts[section] = {**parts.get(section, {}), **values}
    return write_config(tmp, name, **parts)


def rollouts(run):
    files = sorted((run / "rollouts").glob("step-*.jsonl"), key=lambda p: int(p.stem.split("-")[1]))
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


@pytest.fixture(scope="module")
def online_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("online")
    cfg = online_config(tmp)
    run_in_process("train", cfg)
    return cfg, tmp / "run"


def test_each_step_samples_k_scored_completions_per_request(online_run):
    cfg, run = online_run
    requests = {r["id"]: r for r in map(json.loads, (cfg.parent / "train.jsonl").read_text().splitlines())}
    tokenizer = load_tokenizer(None)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    steps = [m for m in metrics_of(run) if m.get("split") is None]
    files = rollouts(run)
    assert len(files) == len(steps) >= 2
    seen = []
    for records, m in zip(files, steps, strict=True):
        rewards = []
        for r in records:
            assert len(r["completion_ids"]) == len(r["rewards"]) == K and "logprobs" not in r
            for ids, reward in zip(r["completion_ids"], r["rewards"]):
                assert 1 <= len(ids) <= LENGTH and all(t not in (im_end, tokenizer.eos_token_id) for t in ids[:-1])
                text = tokenizer.decode(ids[:-1] if ids[-1] in (im_end, tokenizer.eos_token_id) else ids)
                assert reward == pytest.approx(_score(text, requests[r["id"]]["target"]), abs=1e-15)
                rewards.append(reward)
            assert len({tuple(c) for c in r["completion_ids"]}) > 1  # sampled, not greedy
        assert m["reward_mean"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-12)
        assert m["sampled_tokens"] == sum(len(c) for r in records for c in r["completion_ids"]) and m["kl"] >= 0
        seen += [r["id"] for r in records]
    assert sorted(seen) == sorted(requests)  # one epoch: every request sampled once


def test_a_replay_of_step_one_offline_makes_the_online_update(online_run, tmp_path):
    """(and --overwrite removes the rollouts of the run before, not a file of the user's beside them)"""
    cfg, run = online_run
    shutil.copytree(run, tmp_path / "one")
    (tmp_path / "one" / "rollouts" / "step-99.jsonl").write_text("{}\n")
    (tmp_path / "one" / "rollouts" / "notes.txt").write_text("mine")
    run_in_process("train", cfg, "--set", "train.max_steps=1", "--set", f"output_dir={tmp_path / 'one'}",
                   "--overwrite")
    assert sorted(p.name for p in (tmp_path / "one" / "rollouts").iterdir()) == ["notes.txt", "step-1.jsonl"]
    assert (tmp_path / "one" / "rollouts" / "step-1.jsonl").read_bytes() == (run / "rollouts" / "step-1.jsonl"
                                                                                ).read_bytes()
    # the same groups as data: one step over all their packs, no sampling
    replay = run_in_process("train", cfg, "--set", f"data.train={run / 'rollouts' / 'step-1.jsonl'}",
                            "--set", "data.format=pretokenized", "--set", "rl.num_generations=null",
                            "--set", "train.packs_per_step=64", "--set", f"output_dir={tmp_path / 'replay'}")
    assert f"{K * len(rollouts(run)[0])} examples" in replay.stdout, replay.stdout
    online, offline = metrics_of(tmp_path / "one")[0], metrics_of(tmp_path / "replay")[0]
    assert offline["loss"] == pytest.approx(online["loss"], rel=1e-9, abs=1e-15)
    assert offline["kl"] == pytest.approx(online["kl"], rel=1e-9) and offline["examples"] == online["examples"]
    assert adapter_rel(adapter_of(tmp_path / "replay"), adapter_of(tmp_path / "one")) < 1e-9


def test_a_resumed_online_run_samples_and_trains_bit_for_bit(online_run, tmp_path):
    cfg, run = online_run
    steps = len(rollouts(run))
    stopped = run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'r'}", "--set", "train.save_every=1",
                             env={SIGTERM_IN_STEP: str(steps - 1)}, check=False)
    assert stopped.returncode == Preempted.exit_code, stopped.stderr[-2000:]
    assert len(rollouts(tmp_path / "r")) == steps - 1
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'r'}", "--set", "train.save_every=1", "--resume")
    assert rollouts(tmp_path / "r") == rollouts(run)
    assert_equal_adapters(adapter_of(tmp_path / "r"), adapter_of(run))


def test_two_ranks_sample_the_same_groups_and_make_the_one_rank_update(online_run, tmp_path):
    cfg, run = online_run
    run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'two'}")
    assert rollouts(tmp_path / "two") == rollouts(run)
    assert adapter_rel(adapter_of(tmp_path / "two"), adapter_of(run)) < 1e-10


@pytest.mark.parametrize("sets, words", [
    (["train.objective=sft"], "rl.num_generations: samples completions for train.objective grpo, not sft"),
    (["rl.num_generations=1"], "rl.num_generations: must be at least 2"),
    (["rl.temperature=0"], "rl.temperature: must be > 0"),
    (["rl.max_completion_length=400"],
     "rl.num_generations, rl.max_completion_length: 4 completions of up to 400 tokens do not fit one pack"),
    (["packing.max_continuations=3"], "rl.num_generations, rl.max_completion_length: 4 completions"),
])
def test_online_settings_that_cannot_run_are_refused_before_the_model_is_built(tmp_path, sets, words):
    cfg = online_config(tmp_path)
    args = [a for s in sets for a in ("--set", s)]
    err = refused(run_in_process("train", cfg, *args, check=False))
    assert words in " ".join(err.split()), err
    assert not (tmp_path / "run").exists()


def test_scored_groups_in_the_data_of_an_online_run_are_refused(tmp_path):
    groups = tmp_path / "groups.jsonl"
    groups.write_text(json.dumps({"id": "g", "system": "S", "item": "i", "completions": ["a", "b"],
                                  "rewards": [1, 0]}) + "\n")
    cfg = online_config(tmp_path, data={"train": str(groups)})
    err = refused(run_in_process("train", cfg, check=False))
    assert "holds scored groups" in err and "groups.jsonl" in err, err


def test_plan_shows_the_samples_positions_in_tree_packs_against_standalone_sampling(tmp_path):
    cfg = online_config(tmp_path)
    out = run_in_process("plan", cfg).stdout
    assert "x 4 completions of up to 6 tokens an epoch" in " ".join(out.split()), out
    figures = json.loads(run_in_process("plan", cfg, "--json").stdout)["online"]
    examples = load_examples(tmp_path / "train.jsonl", "text")
    assert figures["requests"] == len(examples)
    alone = sum(K * (len(ex.prefix_ids) + len(ex.item_ids) + LENGTH) for ex in examples)
    assert figures["positions_standalone"] == alone
    # P at most once per request and at least once per prompt; each item once, then its K completions
    once = sum(len(ex.item_ids) + K * LENGTH for ex in examples)
    prompts = {ex.prefix_ids for ex in examples}
    most = once + sum(len(ex.prefix_ids) for ex in examples)
    assert once + sum(map(len, prompts)) <= figures["positions_packed"] <= most
    assert figures["position_ratio"] == pytest.approx(alone / figures["positions_packed"])


def test_the_rl_demo_config_samples_from_the_sft_demos_adapter(tmp_path):
    """configs/rl_demo.yaml on an adapter of configs/demo.yaml (a few steps of each: the demos' own figures are in
    README.md): its first steps sample 8 answers to each of one rulebook's 60 requests."""
    sft, rl = tmp_path / "sft", tmp_path / "rl"
    run_in_process("train", REPO / "configs" / "demo.yaml", "--set", "train.max_steps=3", "--set", "generate.every=null",
                   "--set", f"output_dir={sft}")
    out = run_in_process("train", REPO / "configs" / "rl_demo.yaml", "--set", f"model.adapter={sft / 'adapter'}",
                         "--set", "train.max_steps=2", "--set", "generate.every=null", "--set", f"output_dir={rl}")
    said = " ".join(out.stdout.split())
    assert "objective grpo (dapo" in said and "online: each step samples 8 completions of up to 8 tokens per request " \
        "(temperature 1.5, top_p 1), scored by exact against its target" in said, out.stdout
    steps = [m for m in metrics_of(rl) if m.get("split") is None]
    assert len(steps) == 2 and all(m["examples"] == 480 for m in steps)
    for records in rollouts(rl):
        assert len(records) == 60 and len({tuple(r["prefix_ids"]) for r in records}) == 1
        assert all(len(r["completion_ids"]) == 8 for r in records)


def test_answers_past_the_models_positions_are_refused_before_step_0(tmp_path):
    online_config(tmp_path)  # the data
    longest = max(len(ex.prefix_ids) + len(ex.item_ids) for ex in load_examples(tmp_path / "train.jsonl", "text"))
    model = {"config": {**TINY_MODEL, "max_position_embeddings": longest + LENGTH - 1}}
    cfg = online_config(tmp_path, model=model)
    err = refused(run_in_process("train", cfg, check=False))
    assert (f"rl.max_completion_length: {LENGTH} new tokens after a prompt of up to {longest} tokens exceed the "
            f"model's {longest + LENGTH - 1} positions") in " ".join(err.split()), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
