"""Scored groups (packtrain/data/scored.py) read from pretokenized JSONL: K completions become K examples sharing P
and the item, with their rewards and the sampler's log-probabilities; every bad group is refused naming the file,
the line and the field; until grpo trains, every objective refuses them rather than train on them as examples."""

import json
import random
from types import SimpleNamespace

import pytest

from packtrain.data.example import DataError
from packtrain.data.jsonl import load_examples
from packtrain.data.planner import PlanError, plan_packs, plan_stats, plan_tree_packs
from packtrain.data.scored import group_examples
from packtrain.run.objective import Dpo, Sft

GOOD = {"id": "q1", "prefix_ids": [5, 6, 7], "item_ids": [8], "completion_ids": [[9, 10], [11], [12, 13, 14]],
        "rewards": [1, 0.0, 0.5], "logprobs": [[-0.1, -2.0], [-0.5], [0, -1.5, -0.25]]}


def _load(tmp_path, *records):
    path = tmp_path / "groups.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, load_examples(path, "pretokenized")


def test_a_group_is_k_examples_sharing_p_and_the_item(tmp_path):
    _, examples = _load(tmp_path, GOOD, {k: v for k, v in {**GOOD, "id": "q2"}.items() if k != "logprobs"})
    assert [ex.id for ex in examples] == ["q1:0", "q1:1", "q1:2", "q2:0", "q2:1", "q2:2"]
    assert {ex.group for ex in examples} == {"q1", "q2"}
    assert all(ex.prefix_ids == (5, 6, 7) and ex.item_ids == (8,) for ex in examples)
    assert [ex.target_ids for ex in examples[:3]] == [(9, 10), (11,), (12, 13, 14)]
    assert [ex.reward for ex in examples[:3]] == [1.0, 0.0, 0.5]
    assert all(ex.group_rewards == (1.0, 0.0, 0.5) for ex in examples)
    assert examples[0].logprobs == (-0.1, -2.0) and examples[2].logprobs == (0.0, -1.5, -0.25)
    assert all(ex.logprobs is None for ex in examples[3:])  # on-policy: the current policy's, detached
    assert examples[0].prefix_ids is examples[5].prefix_ids  # one P, shared


@pytest.mark.parametrize("change,field,says", [
    ({"completion_ids": [[9, 10]]}, "completion_ids", "2 or more completions"),
    ({"completion_ids": "9 10"}, "completion_ids", "a list of completions"),
    ({"completion_ids": [[9], []], "rewards": [1, 0], "logprobs": None}, "completion_ids[1]", "empty"),
    ({"rewards": [1, 0]}, "rewards", "one number per completion (3), got 2 rewards"),
    ({"rewards": [1, True, 0]}, "rewards[1]", "a finite number"),
    ({"logprobs": [[-0.1, -2.0], [-0.5]]}, "logprobs", "one list per completion (3)"),
    ({"logprobs": [[-0.1], [-0.5], [0, -1.5, -0.25]]}, "logprobs[0]", "1 log-probabilities for completion 0's 2"),
    ({"logprobs": [[-0.1, 0.5], [-0.5], [0, -1.5, -0.25]]}, "logprobs[0][1]", "at most 0"),
    ({"target_ids": [1]}, "target_ids", "not target_ids too"),
    ({"chosen_ids": [1]}, "chosen_ids", "not chosen_ids too"),
    ({"completion": [1]}, "completion", None),  # an unknown key, named
])
def test_a_bad_group_is_refused_naming_file_line_and_field(tmp_path, change, field, says):
    record = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(DataError) as e:
        _load(tmp_path, GOOD, record)
    err = e.value
    assert err.line == 2 and err.field == field and err.source.endswith("groups.jsonl"), str(err)
    assert says is None or says in str(err), str(err)


def test_a_missing_reward_list_is_named(tmp_path):
    record = {k: v for k, v in GOOD.items() if k != "rewards"}
    with pytest.raises(DataError, match="field 'rewards': missing"):
        _load(tmp_path, record)


SYSTEM = "You are a careful clerk. Answer with the code only."


def _write(tmp_path, name, *records):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_text_and_chat_groups_are_each_completion_as_its_own_example(tmp_path):
    """Completion k of a text or chat group is the example the same record with that completion as its target gives;
    chat takes an assistant message or its content."""
    answers = ["toma", "kelu", "rasa sipo"]
    text = load_examples(_write(tmp_path, "t.jsonl", {"id": "q", "system": SYSTEM, "item": "falcon?",
                                                      "completions": answers, "rewards": [1, 0, 0]}), "text")
    alone = load_examples(_write(tmp_path, "a.jsonl", *({"system": SYSTEM, "item": "falcon?", "target": a}
                                                        for a in answers)), "text")
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "falcon?"}]
    chat = load_examples(_write(tmp_path, "c.jsonl", {"id": "q", "messages": prompt, "rewards": [1, 0, 0],
                                                      "completions": ["toma", {"role": "assistant", "content": "kelu"},
                                                                      {"content": "rasa sipo"}]}), "chat")
    for group in (text, chat):
        assert [ex.id for ex in group] == ["q:0", "q:1", "q:2"] and {ex.group for ex in group} == {"q"}
        assert [ex.reward for ex in group] == [1.0, 0.0, 0.0] and all(ex.logprobs is None for ex in group)
        assert all(ex.group_rewards == (1.0, 0.0, 0.0) for ex in group)
        assert [(ex.prefix_ids, ex.item_ids, ex.target_ids) for ex in group] == \
            [(ex.prefix_ids, ex.item_ids, ex.target_ids) for ex in alone]
    counts = [len(ex.target_ids) for ex in alone]
    logprobs = [[-0.5] * n for n in counts]
    again = load_examples(_write(tmp_path, "l.jsonl", {"id": "q", "system": SYSTEM, "item": "falcon?",
                                                       "completions": answers, "rewards": [1, 0, 0],
                                                       "logprobs": logprobs}), "text")
    assert [ex.logprobs for ex in again] == [tuple(x) for x in logprobs]
    logprobs[2] = logprobs[2][:-1]  # the end-of-turn token left out: named with the count the tokenizer gives
    with pytest.raises(DataError) as e:
        load_examples(_write(tmp_path, "b.jsonl", {"id": "q", "system": SYSTEM, "item": "falcon?",
                                                   "completions": answers, "rewards": [1, 0, 0],
                                                   "logprobs": logprobs}), "text")
    assert e.value.field == "logprobs[2]" and f"{counts[2] - 1} log-probabilities for completion 2's {counts[2]} " \
        "tokens" in str(e.value)


@pytest.mark.parametrize("fmt,record,field,says", [
    ("text", {"system": SYSTEM, "item": "x", "completions": ["a", ""], "rewards": [1, 0]}, "completions[1]", "empty"),
    ("text", {"system": SYSTEM, "item": "x", "completions": ["a", 3], "rewards": [1, 0]}, "completions[1]",
     "expected a string"),
    ("text", {"system": SYSTEM, "item": "x", "completions": ["a", "b"], "rewards": [1, "x"]}, "rewards[1]",
     "a finite number"),
    ("text", {"system": SYSTEM, "item": "x", "completions": ["a", "b"], "rewards": [1, 0], "target": "a"}, "target",
     "not target too"),
    ("text", {"system": SYSTEM, "completions": ["a", "b"], "rewards": [1, 0]}, "item", "missing"),
    ("chat", {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}],
              "completions": ["a", {"role": "user", "content": "b"}], "rewards": [1, 0]}, "completions[1].role",
     "an answer is an assistant message"),
    ("chat", {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}],
              "completions": ["a"], "rewards": [1]}, "completions", "2 or more completions"),
    ("chat", {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}],
              "completions": ["a", "b"], "rewards": [1, 0], "chosen": "a"}, "chosen", "not chosen too"),
])
def test_a_bad_text_or_chat_group_is_refused_naming_file_line_and_field(tmp_path, fmt, record, field, says):
    good = {"system": SYSTEM, "item": "x", "target": "a"} if fmt == "text" else \
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"},
                      {"role": "assistant", "content": "a"}]}
    with pytest.raises(DataError) as e:
        load_examples(_write(tmp_path, "g.jsonl", good, record), fmt)
    assert (e.value.line, e.value.field) == (2, field) and says in str(e.value), str(e.value)


def test_groups_train_their_last_turn_only(tmp_path):
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    path = _write(tmp_path, "g.jsonl", {"messages": prompt, "completions": ["a", "b"], "rewards": [1, 0]})
    with pytest.raises(DataError, match="a scored group trains its completions: data.train_on all is not built"):
        load_examples(path, "chat", train_on="all")


@pytest.mark.parametrize("objective", [Sft(), Dpo()])
def test_no_objective_trains_groups_as_plain_examples(tmp_path, objective):
    _, examples = _load(tmp_path, GOOD)
    with pytest.raises(ValueError, match="scored groups|preference pairs"):
        objective.check(examples)


def _groups(n: int = 30, seed: int = 0) -> list:
    """Scored groups of 2..6 completions over two prompts, some with an empty item and completions that start apart
    (nothing in common: the tree cutter could part them), shuffled."""
    rng = random.Random(seed)
    out = []
    for g in range(n):
        prefix = (1, 2, 3) if g % 2 else (4, 5)
        item = () if g % 3 == 0 else tuple(rng.randrange(10, 20) for _ in range(rng.randrange(1, 6)))
        for k in range(rng.randrange(2, 7)):
            answer = (100 + k,) + tuple(rng.randrange(20, 90) for _ in range(rng.randrange(0, 8)))
            out.append(SimpleNamespace(id=f"g{g}:{k}", prefix_ids=prefix, item_ids=item, target_ids=answer,
                                       group=f"g{g}", pair="", side="", images=(), spans=(), weight=1.0))
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("planner", [plan_packs, plan_tree_packs])
@pytest.mark.parametrize("budget,most", [(40, 6), (60, 8), (25, 6), (300, 90)])
def test_a_groups_completions_are_always_in_one_pack(planner, budget, most):
    examples = _groups()
    plan = planner(examples, budget, most, on_overflow="skip")
    where = {e: k for k, pack in enumerate(plan.packs) for e in pack.examples}
    groups = group_examples(examples)
    assert sorted(i for g in groups for i in g) == list(range(len(examples)))
    for members in groups:
        if members[0] in where:
            assert {where.get(i) for i in members} == {where[members[0]]}  # planned whole
        else:
            assert set(members) <= set(plan.skipped)  # or skipped whole
    for pack in plan.packs:
        assert pack.positions <= budget and len(pack.examples) <= most
    assert sum(len(p.examples) for p in plan.packs) + len(plan.skipped) == len(examples)
    if budget == 300:
        assert not plan.skipped and plan_stats(plan, examples)["scored_groups"] == len(groups)


@pytest.mark.parametrize("planner", [plan_packs, plan_tree_packs])
def test_a_group_over_the_budget_or_the_continuations_is_named(planner):
    examples = _groups(n=4)
    with pytest.raises(PlanError, match="scored group needs .* in one pack"):
        planner(examples, 12, 8)
    with pytest.raises(PlanError, match=r"completions go into one pack, over packing.max_continuations=3: raise it"):
        planner(examples, 300, 3)
