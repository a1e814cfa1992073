"""The planner as literal tables: which examples share a pack, in what order, and the exact statistics."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from packtrain.data.jsonl import Example
from packtrain.data.planner import Pack, PlanError, epoch_order, plan_packs, plan_stats

P4 = (11, 12, 13, 14)


def ex(id: str, length: int, prefix=P4, line=0) -> Example:
    """An example whose continuation is `length` tokens: an item of length-1 tokens and a one-token target."""
    return Example(id, prefix, (7,) * (length - 1), (9,), "data.jsonl" if line else "", line)


def packed_ids(plan, examples) -> list[list[str]]:
    return [[examples[i].id for i in pack.examples] for pack in plan.packs]


# (name, len(P), token_budget, max_continuations, [(id, continuation length)], expected packs as ids)
TABLES = [
    ("exactly full", 4, 10, 90, [("a", 3), ("b", 3)], [["a", "b"]]),
    ("one over", 4, 10, 90, [("a", 3), ("b", 4)], [["b"], ["a"]]),
    ("one example is the whole budget", 4, 10, 90, [("a", 6)], [["a"]]),
    ("longest first inside a pack", 1, 20, 90, [("a", 2), ("b", 5), ("c", 3)], [["b", "c", "a"]]),
    ("equal lengths in id order", 1, 20, 90, [("c", 2), ("a", 2), ("b", 2)], [["a", "b", "c"]]),
    ("max continuations", 1, 100, 2, [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1)],
     [["a", "b"], ["c", "d"], ["e"]]),
    ("max continuations of one", 1, 100, 1, [("a", 1), ("b", 2)], [["b"], ["a"]]),
    # first fit would put d into the first pack; best fit picks the pack with the least room left (1, not 2)
    ("best fit, not first fit", 2, 12, 90, [("a", 8), ("b", 6), ("c", 3), ("d", 1)], [["a"], ["b", "c", "d"]]),
    ("best fit fills the tightest pack", 1, 11, 90, [("a", 6), ("b", 5), ("c", 4), ("d", 3), ("e", 2)],
     [["a", "c"], ["b", "d", "e"]]),
]


@pytest.mark.parametrize("name, p_len, budget, max_cont, rows, expected", TABLES, ids=[t[0] for t in TABLES])
def test_pack_tables(name, p_len, budget, max_cont, rows, expected):
    prefix = tuple(range(100, 100 + p_len))
    examples = [ex(i, n, prefix) for i, n in rows]
    plan = plan_packs(examples, budget, max_cont)
    assert packed_ids(plan, examples) == expected
    lengths = dict(rows)
    assert [p.positions for p in plan.packs] == [p_len + sum(lengths[i] for i in pack) for pack in expected]
    assert all(p.positions <= budget for p in plan.packs)
    assert plan.skipped == []


def _pairs(p: int, *conts: int) -> int:
    """A flat pack's causal query-key pairs, counted pair by pair: P's own, each continuation's against P and its
    own earlier tokens."""
    own = lambda n: sum(range(1, n + 1))  # query i sees keys 0..i
    return own(p) + sum(c * p + own(c) for c in conts)


def test_several_prompts_interleaved():
    pa, pb = (1, 1), (2, 2, 2)
    examples = [ex("a1", 3, pa), ex("b1", 3, pb), ex("a2", 4, pa), ex("b2", 4, pb), ex("a3", 5, pa), ex("b3", 2, pb)]
    plan = plan_packs(examples, token_budget=10, max_continuations=90)
    assert plan.prompts == [pa, pb]  # ordered by P's ids, not by first appearance
    # P a leaves room 8: a3 (5), then a2 (4) does not fit and opens a pack, a1 (3) fills the first exactly.
    assert plan.packs == [
        Pack(prompt=0, examples=(4, 0), positions=2 + 5 + 3, attention_pairs=_pairs(2, 5, 3)),
        Pack(prompt=0, examples=(2,), positions=2 + 4, attention_pairs=_pairs(2, 4)),
        Pack(prompt=1, examples=(3, 1), positions=3 + 4 + 3, attention_pairs=_pairs(3, 4, 3)),
        Pack(prompt=1, examples=(5,), positions=3 + 2, attention_pairs=_pairs(3, 2)),
    ]


def test_prompts_of_the_same_length_are_two_ps():
    """Two system prompts of equal token length but other tokens: never one P, and each pack's continuations are
    those of its own P (a1 and a2 hold equal tuples that are different objects, as if loaded from two files)."""
    pa, pb = (1, 2, 3), (1, 2, 4)
    examples = [ex("a1", 2, pa), ex("b1", 2, pb), ex("a2", 3, tuple(t for t in pa)), ex("b2", 3, pb)]
    plan = plan_packs(examples, token_budget=20, max_continuations=90)
    assert plan.prompts == [pa, pb]
    assert plan.packs == [Pack(prompt=0, examples=(2, 0), positions=3 + 3 + 2, attention_pairs=_pairs(3, 3, 2)),
                          Pack(prompt=1, examples=(3, 1), positions=3 + 3 + 2, attention_pairs=_pairs(3, 3, 2))]
    for pack in plan.packs:
        assert all(examples[i].prefix_ids == plan.prompts[pack.prompt] for i in pack.examples)


def test_input_order_does_not_change_the_plan():
    prefixes = [(1,) * 3, (2,) * 5, (1, 2)]
    rng = random.Random(0)
    examples = [ex(f"e{k}", rng.randint(1, 9), prefixes[k % 3]) for k in range(60)]
    reference = plan_packs(examples, token_budget=25, max_continuations=4)
    as_ids = packed_ids(reference, examples)
    for seed in range(5):
        shuffled = examples[:]
        random.Random(seed).shuffle(shuffled)
        plan = plan_packs(shuffled, token_budget=25, max_continuations=4)
        assert packed_ids(plan, shuffled) == as_ids
        assert plan.prompts == reference.prompts
        assert [p.positions for p in plan.packs] == [p.positions for p in reference.packs]


_PLAN_IN_A_SUBPROCESS = """
import json, random
from packtrain.data.jsonl import Example
from packtrain.data.planner import epoch_order, plan_packs
rng = random.Random(3)
prefixes = [tuple(rng.randrange(50) for _ in range(rng.randint(1, 6))) for _ in range(7)]
examples = [Example(f"id-{k}", rng.choice(prefixes), (5,) * rng.randint(0, 9), (6,)) for k in range(400)]
plan = plan_packs(examples, token_budget=40, max_continuations=5, seed=11)
print(json.dumps({"packs": [[examples[i].id for i in p.examples] for p in plan.packs],
                  "orders": [epoch_order(plan, e, 11) for e in range(3)]}))
"""


@pytest.mark.process  # Python's hash seed is fixed when an interpreter starts
def test_the_plan_is_the_same_in_every_process():
    runs = []
    for hash_seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", _PLAN_IN_A_SUBPROCESS], env=env, capture_output=True, text=True,
                             check=True).stdout
        runs.append(json.loads(out))
    assert runs[0] == runs[1] == runs[2]
    assert len(runs[0]["packs"]) > 10 and runs[0]["orders"][0] != runs[0]["orders"][1]


@pytest.mark.process  # a fresh interpreter: this one has imported both
def test_planning_imports_neither_torch_nor_transformers():
    code = ("import sys, packtrain.data.planner, packtrain.data.jsonl, packtrain.commands.plan; "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    # `packtrain plan` itself, on a config with a task metric (generate.every: its scorer and tokenizer are checked)
    # and over two ranks: the tokenizer needs transformers, nothing needs torch (6 s of imports, 1.5 s without)
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    code = ("import sys; from packtrain.cli import main; main(['plan', sys.argv[1], '--world-size', '2']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(demo)], capture_output=True, text=True, check=True).stdout
    assert yaml.safe_load(demo.read_text())["generate"]["every"]  # the premise: the demo checks its task metric
    assert out.splitlines()[-1] == "False", out[-2000:]


def test_overflow_is_an_error_naming_file_line_and_id():
    examples = [ex("fits", 6, line=1), ex("too-long", 7, line=2)]
    with pytest.raises(PlanError) as e:
        plan_packs(examples, token_budget=10, max_continuations=90)
    assert str(e.value).startswith("data.jsonl:2: example 'too-long' needs 11 positions (P 4 + continuation 7), "
                                   "over packing.token_budget=10")


def test_overflow_can_be_skipped_and_counted():
    examples = [ex("a", 7), ex("b", 3), ex("c", 9), ex("d", 2)]
    plan = plan_packs(examples, token_budget=10, max_continuations=90, on_overflow="skip")
    assert plan.skipped == [0, 2]
    assert packed_ids(plan, examples) == [["b", "d"]]
    stats = plan_stats(plan, examples)
    assert (stats["examples"], stats["skipped"]) == (2, 2)


def test_a_p_longer_than_the_budget_overflows_every_example():
    examples = [ex("a", 1, prefix=(1,) * 10), ex("b", 1)]
    plan = plan_packs(examples, token_budget=10, max_continuations=90, on_overflow="skip")
    assert packed_ids(plan, examples) == [["b"]]
    assert plan.prompts == [P4]


def test_nothing_to_pack_is_an_error():
    with pytest.raises(PlanError, match="no examples"):
        plan_packs([], token_budget=10, max_continuations=90)
    with pytest.raises(PlanError, match=r"no example fits packing.token_budget=10 \(1 skipped\)"):
        plan_packs([ex("a", 7)], token_budget=10, max_continuations=90, on_overflow="skip")


def test_epoch_order_is_a_seeded_shuffle():
    examples = [ex(str(k), 5) for k in range(40)]
    plan = plan_packs(examples, token_budget=10, max_continuations=90, seed=3)
    assert len(plan.packs) == 40
    orders = [epoch_order(plan, e, 3) for e in range(3)]
    assert all(sorted(o) == list(range(40)) for o in orders)
    assert orders[0] != orders[1] != orders[2]
    assert epoch_order(plan, 0, 3) == orders[0]
    assert epoch_order(plan, 0) == orders[0]  # the plan's own seed by default
    assert epoch_order(plan, 0, 4) != orders[0]


def test_stats_of_a_small_plan():
    # P = 4, budget 10: c (5) fills one pack, a and b (3 each) the other.
    examples = [ex("a", 3), ex("b", 3), ex("c", 5)]
    plan = plan_packs(examples, token_budget=10, max_continuations=90)
    assert packed_ids(plan, examples) == [["c"], ["a", "b"]]
    assert plan_stats(plan, examples) == {
        "examples": 3,
        "conversations": 3,  # examples made in code (no line) each count as their own
        "turns": 3,
        "target_tokens": 3,  # one target token each
        "whole_differs": 0,  # pretokenized: no render to differ from
        "preference_pairs": 0,
        "scored_groups": 0,
        "weighted": 0,
        "skipped": 0,
        "walked": 0,
        "walk_chunks": 0,
        "prompts": 1,
        "packs": 2,
        "continuations_min": 1,
        "continuations_median": 1,
        "continuations_max": 2,
        "token_budget": 10,
        "budget_utilisation": 19 / 20,
        "positions_standalone": 7 + 7 + 9,
        "positions_packed": 9 + 10,
        "position_ratio": 23 / 19,
        # 7*8/2 twice and 9*10/2
        "attention_pairs_standalone": 28 + 28 + 45,
        # pack [c]: 4*5/2 + 5*4 + 5*6/2; pack [a, b]: 4*5/2 + 2 * (3*4 + 3*4/2)
        "attention_pairs_packed": (10 + 20 + 15) + (10 + 2 * (12 + 6)),
        "attention_pair_ratio": 101 / 91,
    }


def test_the_seeds_illustration():
    """One 64,000-token P shared by 80 continuations of 1,000 tokens, budget 150,000: one pack."""
    prefix = tuple(range(64_000))
    examples = [Example(str(k), prefix, (1,) * 900, (2,) * 100) for k in range(80)]
    plan = plan_packs(examples, token_budget=150_000, max_continuations=90)
    stats = plan_stats(plan, examples)
    assert stats["packs"] == 1
    assert stats["positions_standalone"] == 5_200_000
    assert stats["positions_packed"] == 144_000
    assert round(stats["position_ratio"], 1) == 36.1
    assert stats["attention_pairs_standalone"] == 169_002_600_000
    assert stats["attention_pairs_packed"] == 7_208_072_000
    assert round(stats["attention_pair_ratio"], 1) == 23.4


def test_the_fingerprint_sees_every_token_of_p_item_and_target():
    """`train --resume` refuses edited data by this fingerprint: a token of P, of an item or of a target changed,
    lengths kept, is another fingerprint (and an unchanged copy of the data is the same one)."""
    from packtrain.data.planner import plan_fingerprint

    def fingerprint(examples):
        return plan_fingerprint(plan_packs(examples, token_budget=20, max_continuations=90), examples)

    base = [ex("a", 3), ex("b", 4)]
    edits = [Example("a", P4, (7, 8), (9,)),  # an item token
             Example("a", P4, (7, 7), (8,)),  # a target token
             Example("a", (11, 12, 13, 15), (7, 7), (9,))]  # a token of P
    assert fingerprint([ex("a", 3), ex("b", 4)]) == fingerprint(base)
    for edited in edits:
        assert fingerprint([edited, base[1]]) != fingerprint(base), edited
