"""packtrain/run/rollouts.py's parts (the online runs themselves: tests/commands/test_grpo_online.py): a rollouts
file's records become the examples the offline reader makes of the same file; the largest group a request can
sample; each step's seed."""

import dataclasses
import json

from packtrain.data.example import Example
from packtrain.data.jsonl import load_examples
from packtrain.data.prefix_tree import example_tree
from packtrain.run.rollouts import group_examples, rollouts_path, sampling_plan, step_seed, worst_case_group

RECORDS = [{"id": "a", "prefix_ids": [5, 6, 7], "item_ids": [8], "completion_ids": [[9, 2], [9, 10, 11], [12]],
            "rewards": [1.0, 0.0, 0.5]},
           {"id": "b", "prefix_ids": [5, 6, 7], "item_ids": [], "completion_ids": [[3], [4, 2]], "rewards": [0, 0]}]


def test_the_records_become_what_the_offline_reader_makes_of_the_file(tmp_path):
    path = rollouts_path(tmp_path, 3)
    assert path == tmp_path / "rollouts" / "step-3.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    read = load_examples(path, "pretokenized")
    made = group_examples(RECORDS, path)
    assert [dataclasses.asdict(e) for e in made] == [dataclasses.asdict(e) for e in read]
    assert [e.id for e in made] == ["a:0", "a:1", "a:2", "b:0", "b:1"]
    assert made[1].target_ids == (9, 10, 11) and made[1].group_rewards == (1.0, 0.0, 0.5) and made[1].logprobs is None


def test_the_worst_case_group_is_k_distinct_completions_of_the_full_length():
    ex = Example("r", (1, 2, 3), (4, 5), (6,))
    group = worst_case_group(ex, 4, 7)
    assert [len(e.target_ids) for e in group] == [7] * 4 and len({e.target_ids for e in group}) == 4
    assert {e.group for e in group} == {"r"} and all(e.item_ids == (4, 5) for e in group)
    # as a tree: P, the item once, then every completion whole (nothing shared past the item)
    assert sum(len(n.tokens) for n in example_tree(group).nodes) == 2 + 4 * 7


def test_each_step_has_its_own_seed_and_a_run_seed_moves_them_all():
    seeds = [step_seed(0, n) for n in range(1000)]
    assert len(set(seeds)) == 1000
    assert not set(seeds) & {step_seed(1, n) for n in range(1000)}
    assert all(0 <= step_seed(2**40, n) < 2**31 for n in range(10))


def test_the_samples_are_planned_at_the_longest_answer_not_the_targets_length():
    from types import SimpleNamespace

    cfg = SimpleNamespace(rl=SimpleNamespace(max_completion_length=30), train=SimpleNamespace(seed=0),
                          packing=SimpleNamespace(token_budget=100, max_continuations=16))
    copies = [Example(f"r:{j}", (1,) * 20, (2, 3), (4,)) for j in range(8)]  # a 1-token target, answers up to 30
    plan = sampling_plan(cfg, copies)
    assert sorted(e for pack in plan.packs for e in pack.examples) == list(range(8))
    # each pack: P once, then its rows' items and room for 30 tokens each, within the budget
    assert all(20 + len(pack.examples) * (2 + 30) <= 100 for pack in plan.packs) and len(plan.packs) == 4
