"""`packtrain train` with train.objective grpo through the real CLI, on text scored groups (``system``, ``item``,
``completions``, ``rewards``, some with the sampler's ``logprobs``): the tree run equals the standalone run (each
completion its own sequence), 2 ranks over gloo give the 1-rank adapter, each step's figures are in metrics.jsonl,
and `plan` counts the groups. The exactness of the step itself (against each completion alone through transformers
+ peft and TRL's formulas) is tests/run/test_grpo.py's."""

import json

import pytest
from cli_helpers import (
    RULEBOOKS,
    SGD,
    adapter_of,
    adapter_rel,
    assert_equal_adapters,
    metrics_of,
    run_in_process,
    run_ranks,
    write_config,
)

from packtrain.data.jsonl import load_examples
from packtrain.exits import Preempted
from packtrain.faults import SIGTERM_IN_STEP

COLOURS = ["red", "blue", "green"]


def write_groups(path, logprobs_of=None):
    """A group per rulebook and colour: four answers (codes, some sharing their first word), rewarded 1 where right
    and 0 else; ``logprobs_of``: a group's examples -> its completions' log-probabilities, for every other group."""
    codes = ["alpha", "beta", "gamma", "delta"]
    right = [dict(zip(COLOURS, codes)), dict(zip(COLOURS, ["gamma", "alpha", "beta"]))]
    lines = []
    for r, system in enumerate(RULEBOOKS):
        for i, colour in enumerate(COLOURS):
            answer = right[r][colour] if r < 2 else f"{colour} {colour}"
            completions = [f"code {answer}", "code delta", f"code {codes[(i + 1) % 3]}", answer]
            lines.append({"id": f"r{r}-{colour}", "system": system, "item": f"Colour: {colour}",
                          "completions": completions, "rewards": [1.0, 0.0, 0.0, 0.5]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    if logprobs_of is not None:
        examples = load_examples(path, "text")
        for k, line in enumerate(lines):
            if k % 2:
                line["logprobs"] = logprobs_of(examples[4 * k:4 * k + 4])
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _logprobs(examples):
    """Made-up sampler log-probabilities, one per token of each completion as packtrain tokenizes it."""
    return [[-0.5 - 0.1 * (t % 7) for t in range(len(ex.target_ids))] for ex in examples]


# 9 groups of 4 in tree packs (at most 8 completions each: two groups), 2 steps of 3 packs, a KL term
GRPO = {"objective": "grpo", "epochs": 1, "packs_per_step": 3}
RL = {"loss_type": "dapo", "beta": 0.04, "epsilon_high": 0.28}


@pytest.fixture(scope="module")
def tree_run(tmp_path_factory):
    """(the config, the run directory) of one 1-rank tree run, in this process."""
    tmp = tmp_path_factory.mktemp("grpo")
    data = write_groups(tmp / "groups.jsonl", _logprobs)
    cfg = write_config(tmp, data={"train": str(data), "eval": None}, optim=SGD, train=GRPO, rl=RL,
                       packing={"mode": "tree", "max_continuations": 8})
    out = run_in_process("train", cfg, "--set", f"output_dir={tmp / 'tree'}")
    assert "objective grpo (dapo, token-level ratio, clip [0.8, 1.28]" in " ".join(out.stdout.split()), out.stdout
    return cfg, tmp / "tree"


def test_the_tree_run_equals_each_completion_alone_and_records_its_figures(tree_run, tmp_path):
    cfg, tree = tree_run
    # standalone plans its packs flat (a group's four items and answers in one pack of the budget)
    alone = run_in_process("train", cfg, "--set", "packing.mode=standalone", "--set", "packing.token_budget=400",
                           "--set", f"output_dir={tmp_path / 'alone'}")
    assert "mode standalone" in alone.stdout
    steps = [m for m in metrics_of(tree) if m.get("split") != "eval"]
    assert len(steps) == 2 and [m["examples"] for m in steps] != [0, 0]
    for a, b in zip(steps, metrics_of(tmp_path / "alone"), strict=True):
        # the model's float32 casts stay through the CLI (the GDN gate's `a`): packed and standalone differ by their
        # rounding, as tests/commands/test_chat_cli.py's runs do
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9) and a["kl"] == pytest.approx(b["kl"], rel=1e-6)
        assert a["clip_fraction"] == b["clip_fraction"] and a["reward_mean"] == b["reward_mean"]
    assert adapter_rel(adapter_of(tmp_path / "alone"), adapter_of(tree)) < 1e-6
    # the data's figures: every group rewards 1, 0, 0 and 0.5; the sampler's log-probabilities make ratios != 1
    assert all(m["reward_mean"] == 0.375 and m["equal_reward_groups"] == 0 for m in steps)
    assert any(m["clip_fraction"] > 0 for m in steps) and all(m["kl"] > 0 for m in steps[1:])


def test_two_ranks_give_the_one_rank_grpo_adapter(tree_run, tmp_path):
    cfg, one = tree_run
    run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'two'}")
    for a, b in zip(metrics_of(one), metrics_of(tmp_path / "two"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-10) and a["clip_fraction"] == b["clip_fraction"]
    assert adapter_rel(adapter_of(tmp_path / "two"), adapter_of(one)) < 1e-10


def test_plan_counts_the_groups_and_their_positions(tree_run):
    cfg, _ = tree_run
    out = run_in_process("plan", cfg).stdout
    assert "groups     9 scored groups, each group's completions in one pack" in out, out


def test_the_kl_reference_is_precomputed_per_token_read_back_on_resume_and_equals_per_step(tree_run, tmp_path):
    """rl.beta > 0 on the data's groups under train.dpo_reference precompute (the default): one pass before step 0
    writes each completion's reference token log-probabilities to OUTPUT/reference.json; the run equals a per_step
    run (a reference forward before each unit's training forward), and a resume reads the table back."""
    cfg, tree = tree_run
    out = (tree / "config.yaml").read_text()
    assert "dpo_reference: precompute" in out
    table = json.loads((tree / "reference.json").read_text())["log_probs"]
    examples = load_examples(cfg.parent / "groups.jsonl", "text")
    assert {ex.id: len(ex.target_ids) for ex in examples} == {k: len(v) for k, v in table.items()}
    per_step = run_in_process("train", cfg, "--set", "train.dpo_reference=per_step", "--set",
                              f"output_dir={tmp_path / 'per_step'}")
    assert "a no-grad forward of each unit before its training forward" in " ".join(per_step.stdout.split())
    assert not (tmp_path / "per_step" / "reference.json").exists()
    for a, b in zip(metrics_of(tree), metrics_of(tmp_path / "per_step"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9) and a["kl"] == pytest.approx(b["kl"], rel=1e-9)
    assert adapter_rel(adapter_of(tmp_path / "per_step"), adapter_of(tree)) < 1e-9
    stopped = run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'r'}", "--set", "train.save_every=1",
                             env={SIGTERM_IN_STEP: "1"}, check=False)
    assert stopped.returncode == Preempted.exit_code, stopped.stderr[-2000:]
    resumed = run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'r'}", "--set", "train.save_every=1",
                             "--resume")
    assert f"grpo reference: {len(examples)} log-probabilities read from" in resumed.stdout, resumed.stdout
    assert_equal_adapters(adapter_of(tmp_path / "r"), adapter_of(tree))


def test_two_ranks_precompute_the_reference_of_an_odd_number_of_packs(tree_run, tmp_path):
    """One group a pack (9 packs): the reference pass's last batch holds a pack on rank 0 and a dummy on rank 1."""
    cfg, one = tree_run
    run_ranks(2, "train", str(cfg), "--set", "packing.max_continuations=4", "--set", "train.packs_per_step=2",
              "--set", f"output_dir={tmp_path / 'two'}")
    table = json.loads((tmp_path / "two" / "reference.json").read_text())["log_probs"]
    mine = json.loads((one / "reference.json").read_text())["log_probs"]
    assert table.keys() == mine.keys()
    assert all(v == pytest.approx(mine[k], rel=1e-12, abs=1e-12) for k, v in table.items())
