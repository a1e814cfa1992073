"""Balanced steps (train.balance: cost, packtrain/run/balance.py): every pack once per epoch, the same steps on any
number of ranks, the same number of packs per rank, steps no more costly than round robin's, diverse; `plan --json`
reports a schedule and a utilisation that can be recomputed from it."""

import json
import os
import subprocess
import sys

import pytest
from cli_helpers import REPO, run_in_process, write_config

from packtrain.data.jsonl import Example
from packtrain.data.planner import plan_packs
from packtrain.models.cost import CostModel
from packtrain.run.balance import distinct_prompts, epoch_steps, pack_costs, step_pack_ids, utilisation


def _examples(n_prompts=12, seed=0):
    import random

    rng = random.Random(seed)
    out = []
    for k in range(n_prompts):
        prefix = (k,) * rng.randint(20, 200)
        for j in range(rng.randint(3, 40)):
            out.append(Example(f"{k}-{j}", prefix, (5,) * rng.randint(5, 60), (6,)))
    return out


MODEL = CostModel(per_position=100.0, per_pair=1.0)


@pytest.fixture(scope="module")
def planned():
    examples = _examples()
    plan = plan_packs(examples, token_budget=400, max_continuations=8)
    return plan, examples, pack_costs(plan, examples, MODEL)


@pytest.mark.parametrize("balance", ["cost", "round_robin"])
@pytest.mark.parametrize("per_step,world", [(8, 8), (16, 8), (7, 3), (5, 8), (1, 1)])
def test_every_pack_once_per_epoch_and_equal_packs_per_rank(planned, balance, per_step, world):
    plan, _, costs = planned
    for epoch in range(3):
        sched = epoch_steps(plan, costs, epoch, 0, per_step, world, balance)
        assert sorted(i for ranks in sched for packs in ranks for i in packs) == list(range(len(plan.packs)))
        assert len(sched) == -(-len(plan.packs) // per_step)
        for ranks in sched:
            counts = [len(p) for p in ranks]
            assert len(ranks) == world and max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
            ids = step_pack_ids(ranks)
            assert [ids[r::world] for r in range(world)] == ranks  # what rank_units slices is the schedule


def test_a_step_holds_the_same_packs_on_any_number_of_ranks(planned):
    plan, _, costs = planned
    sets = {w: [sorted(i for p in ranks for i in p) for ranks in epoch_steps(plan, costs, 1, 3, 16, w)]
            for w in (1, 2, 4, 16)}
    assert sets[1] == sets[2] == sets[4] == sets[16]


def test_cost_balance_beats_round_robin_and_keeps_the_steps_diverse(planned):
    plan, _, costs = planned
    for epoch in range(3):
        cost = epoch_steps(plan, costs, epoch, 0, 8, 8, "cost")
        rr = epoch_steps(plan, costs, epoch, 0, 8, 8, "round_robin")
        assert utilisation(cost, costs) > utilisation(rr, costs) + 0.05
        assert distinct_prompts(cost, plan) >= 0.8 * distinct_prompts(rr, plan)
    # reshuffled every epoch, seeded: another seed orders them otherwise
    assert epoch_steps(plan, costs, 0, 0, 8, 8) != epoch_steps(plan, costs, 1, 0, 8, 8)
    assert epoch_steps(plan, costs, 0, 5, 8, 8) != epoch_steps(plan, costs, 0, 6, 8, 8)


@pytest.mark.process
def test_the_seeded_steps_are_the_same_in_every_process(planned):
    """Every rank computes the steps alone: another interpreter (another string hash seed) must get the same ones,
    or the ranks would train different packs in the same step."""
    import json
    import pickle
    import subprocess
    import sys

    from cli_helpers import REPO

    plan, _, costs = planned
    code = ("import json, pickle, sys; from packtrain.run.balance import epoch_steps; "
            "plan, costs = pickle.load(sys.stdin.buffer); print(json.dumps(epoch_steps(plan, costs, 0, 5, 8, 8)))")
    outs = [subprocess.run([sys.executable, "-c", code], input=pickle.dumps((plan, costs)), capture_output=True,
                           env={"PYTHONPATH": str(REPO), "PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
                           check=True).stdout for seed in ("1", "2")]
    assert json.loads(outs[0]) == json.loads(outs[1]) == json.loads(json.dumps(epoch_steps(plan, costs, 0, 5, 8, 8)))


def test_utilisation_is_mean_over_largest_rank_cost():
    costs = [4.0, 2.0, 2.0, 1.0]
    assert utilisation([[[0], [1]], [[2, 3], []]], costs) == pytest.approx(((6 / 2) / 4 + (3 / 2) / 3) / 2)


def test_plan_json_schedule_recomputes_to_the_reported_utilisation(tmp_path):
    cfg = write_config(tmp_path, train={"packs_per_step": 4})
    out = json.loads(run_in_process("plan", cfg, "--json", "--world-size", "2").stdout)
    assert out["packs"] == len(out["pack_positions"]) == len(out["pack_cost"])
    model = out["cost_model"]
    from packtrain.data.jsonl import load_examples

    examples = load_examples(tmp_path / "train.jsonl")
    plan = plan_packs(examples, 208, 3)  # write_config's packing
    assert [p.positions for p in plan.packs] == out["pack_positions"]
    costs = []
    for p in plan.packs:  # the cost model by hand: positions, and P's pairs plus each continuation's
        n, conts = len(plan.prompts[p.prompt]), [examples[e].len_continuation for e in p.examples]
        pairs = n * (n + 1) / 2 + sum(c * n + c * (c + 1) / 2 for c in conts)
        costs.append(model["per_position"] * (n + sum(conts)) + model["per_pair"] * pairs)
    assert out["pack_cost"] == pytest.approx(costs, rel=1e-12)
    # and from the JSON alone: cost = per position x positions + per pair x pairs
    assert out["pack_cost"] == pytest.approx([model["per_position"] * n + model["per_pair"] * pairs for n, pairs
                                              in zip(out["pack_positions"], out["pack_attention_pairs"], strict=True)],
                                             rel=1e-12)
    sched = out["schedule"]
    assert sorted(i for step in sched for rank in step for i in rank) == list(range(out["packs"]))
    recomputed = sum(sum(map(sum, ([costs[i] for i in r] for r in step))) / 2
                     / max(sum(costs[i] for i in r) for r in step) for step in sched) / len(sched)
    assert out["utilisation"]["cost"] == pytest.approx(recomputed, rel=1e-12)
    assert out["utilisation"]["cost"] >= out["utilisation"]["round_robin"]
    table = run_in_process("plan", cfg, "--world-size", "2").stdout
    assert f"utilisation (mean / largest rank cost per step, epoch 0) cost {out['utilisation']['cost']:.3f}" in table


def test_a_tree_pack_costs_its_trees_positions_and_pairs():
    from packtrain.data.planner import plan_tree_packs

    examples = [Example(i, (1, 2), item, (9,)) for i, item in (("a", (3, 4)), ("b", (3, 5)), ("c", (3, 4, 9)))]
    [pack] = plan_tree_packs(examples, 100, 90).packs
    # after P (2): "3" (start 0), "4 9" (start 1, a's end), "9" (start 3, c's), "5 9" (start 1, b's): 6 tokens,
    # each reading P, the tokens before it on its path and itself
    assert (pack.positions, pack.attention_pairs) == (8, 3 + (1 * 2 + 1) + (2 * 3 + 3) + (1 * 5 + 1) + (2 * 3 + 3))
    assert pack_costs(plan_tree_packs(examples, 100, 90), examples, MODEL) == [100.0 * 8 + 1.0 * 30]


def test_plan_json_tree_costs_are_the_trees(tmp_path):
    from packtrain.data.jsonl import load_examples
    from packtrain.data.planner import plan_tree_packs
    from packtrain.data.prefix_tree import example_tree
    from packtrain.data.tree_packs import attention_pairs

    out = json.loads(run_in_process("plan", write_config(tmp_path, packing={"mode": "tree"}), "--json").stdout)
    examples = load_examples(tmp_path / "train.jsonl")
    plan = plan_tree_packs(examples, 208, 3)  # write_config's packing
    assert [p.positions for p in plan.packs] == out["pack_positions"]
    trees = [example_tree([examples[i] for i in p.examples]) for p in plan.packs]
    prefixes = [len(plan.prompts[p.prompt]) for p in plan.packs]
    assert out["pack_positions"] == [n + t.positions for n, t in zip(prefixes, trees, strict=True)]
    assert out["pack_attention_pairs"] == [attention_pairs(n, t) for n, t in zip(prefixes, trees, strict=True)]
    model = out["cost_model"]
    assert out["pack_cost"] == pytest.approx([model["per_position"] * n + model["per_pair"] * pairs for n, pairs
                                              in zip(out["pack_positions"], out["pack_attention_pairs"], strict=True)],
                                             rel=1e-12)
    assert out["positions_packed"] < out["positions_shared_prefix"]


@pytest.mark.process
def test_every_process_computes_the_same_schedule(tmp_path):
    """Ranks agree: the schedule depends on the plan and the seed alone, not on the process's hash seed."""
    cfg = write_config(tmp_path, train={"packs_per_step": 4})
    outs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run([sys.executable, "-m", "packtrain", "plan", str(cfg), "--json", "--world-size", "2"],
                              capture_output=True, text=True, env=env, cwd=REPO, check=True)
        outs.append(json.loads(proc.stdout)["schedule"])
    assert outs[0] == outs[1]


def _prompts_plan(prompts: str):
    """A plan stand-in: pack i has prompt prompts[i] (all the step rules read of a plan)."""
    from types import SimpleNamespace

    return SimpleNamespace(packs=[SimpleNamespace(prompt=p) for p in prompts], seed=0)


def test_packs_go_to_ranks_costliest_first():
    from packtrain.run.balance import _to_ranks

    # costliest first to the least loaded rank: 10 | 3, then 2 to the lighter rank 1, and 1 to rank 0 (rank 1 full)
    assert _to_ranks([0, 1, 2, 3], [1.0, 2.0, 3.0, 10.0], 2) == [[3, 0], [2, 1]]
    # 5 packs on 2 ranks: the first rank takes the extra one
    assert _to_ranks([0, 1, 2, 3, 4], [5.0, 4.0, 3.0, 2.0, 1.0], 2) == [[0, 3, 4], [1, 2]]


def test_the_diversity_rule_allows_exactly_per_step_minus_distinct_repeats():
    from packtrain.run.balance import _similar_cost_steps

    # prompts in cost order A A A A B C D E, 4 packs a step, 3 distinct: one repeat of A per step, the other As wait
    plan, costs = _prompts_plan("AAAABCDE"), [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    assert _similar_cost_steps(plan, list(range(8)), costs, 4, 3) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _similar_cost_steps(plan, list(range(8)), costs, 4, 2) == [[0, 1, 2, 4], [3, 5, 6, 7]]
    assert _similar_cost_steps(plan, list(range(8)), costs, 4, 1) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("seed", range(4))
def test_a_step_keeps_the_ceiling_of_85_percent_of_round_robins_prompts(seed):
    # two prompts, the As costlier: round robin's steps hold 1 or 2 prompts, on average more than 1 / 0.85, so each
    # step must hold ceil(0.85 x that) = 2 prompts, where cost order alone would give A A A A, then B B B B
    from packtrain.data.planner import epoch_order

    plan, costs = _prompts_plan("AAAABBBB"), [9.0, 8.0, 7.0, 6.0, 4.0, 3.0, 2.0, 1.0]
    order = epoch_order(plan, 0, seed)
    rounds = [{plan.packs[i].prompt for i in order[k:k + 4]} for k in (0, 4)]
    assert sum(map(len, rounds)) / 2 > 1 / 0.85
    schedule = epoch_steps(plan, costs, 0, seed, per_step=4, world=2)
    assert [len({plan.packs[i].prompt for r in step for i in r}) for step in schedule] == [2, 2]
