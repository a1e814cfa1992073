"""Preference pairs and weights in the three formats (packtrain.data.preference): two examples per pair sharing P
and the item, the errors naming file, line and field, the planners keeping a pair's answers in one pack, and the
objective refusing data and settings it does not train on."""

import json
import random
from pathlib import Path

import pytest

from packtrain.config import ConfigError, config_from_dict
from packtrain.data.example import DataError, LineErrors
from packtrain.data.jsonl import load_examples
from packtrain.data.planner import plan_packs, plan_tree_packs
from packtrain.data.preference import pair_examples
from packtrain.run.objective import Dpo, Sft, Weighted

SYSTEM = "You are a careful clerk. Answer with the code only."
CHAT_PROMPT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "code of falcon?"}]


def write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_text_pair_is_two_examples_sharing_p_and_the_item(tmp_path):
    path = write(tmp_path, [{"id": "a", "system": SYSTEM, "item": "falcon?", "chosen": "toma", "rejected": "kelu"},
                            {"system": SYSTEM, "item": "river?", "target": "mi", "weight": 2.5}])
    with pytest.raises(ValueError):  # a pair beside a plain example: loaded, but refused by either objective
        Dpo().check(load_examples(path))
    chosen, rejected, plain = load_examples(path)
    assert (chosen.id, chosen.pair, chosen.side) == ("a:chosen", "a", "chosen")
    assert (rejected.id, rejected.pair, rejected.side) == ("a:rejected", "a", "rejected")
    assert chosen.prefix_ids == rejected.prefix_ids and chosen.item_ids == rejected.item_ids
    assert chosen.target_ids != rejected.target_ids
    assert (plain.pair, plain.weight, chosen.weight) == ("", 2.5, 1.0)
    # each answer is what the same record with that answer as its target gives
    alone = write(tmp_path, [{"system": SYSTEM, "item": "falcon?", "target": t} for t in ("toma", "kelu")],
                  "alone.jsonl")
    assert [ex.target_ids for ex in load_examples(alone)] == [chosen.target_ids, rejected.target_ids]


def test_the_chat_pair_forms_are_one_pair(tmp_path):
    forms = [([{"role": "assistant", "content": "toma"}], [{"role": "assistant", "content": "kelu"}]),  # TRL's
             ({"role": "assistant", "content": "toma"}, {"content": "kelu"}), ("toma", "kelu")]
    loaded = [load_examples(write(tmp_path, [{"id": "q", "messages": CHAT_PROMPT, "chosen": c, "rejected": r}],
                                  f"c{k}.jsonl")) for k, (c, r) in enumerate(forms)]
    assert all([(e.id, e.item_ids, e.target_ids) for e in ex] == [(e.id, e.item_ids, e.target_ids) for e in loaded[0]]
               for ex in loaded)
    text = load_examples(write(tmp_path, [{"id": "q", "system": SYSTEM, "item": "code of falcon?", "chosen": "toma",
                                           "rejected": "kelu"}], "t.jsonl"))
    assert [e.target_ids for e in text] == [e.target_ids for e in loaded[0]]
    assert [e.item_ids for e in text] == [e.item_ids for e in loaded[0]]


def test_a_pretokenized_pair(tmp_path):
    path = write(tmp_path, [{"prefix_ids": [5, 6, 7], "item_ids": [8], "chosen_ids": [9, 10], "rejected_ids": [11],
                             "weight": -0.5}])
    chosen, rejected = load_examples(path, vocab_size=50)
    assert (chosen.id, chosen.target_ids, rejected.target_ids, chosen.weight) == ("1:chosen", (9, 10), (11,), -0.5)
    assert pair_examples([chosen, rejected]) == [(0, 1)]


@pytest.mark.parametrize("row,field,words", [
    ({"system": SYSTEM, "item": "x", "chosen": "toma"}, "rejected", "missing"),
    ({"system": SYSTEM, "item": "x", "rejected": "toma"}, "chosen", "missing"),
    ({"system": SYSTEM, "item": "x", "chosen": "toma", "rejected": "toma"}, "rejected", "same answer"),
    ({"system": SYSTEM, "item": "x", "chosen": "a", "rejected": "b", "target": "c"}, "target", "not target too"),
    ({"system": SYSTEM, "item": "x", "chosen": "a", "rejected": "b", "score": 1}, "score", "unknown key"),
    ({"system": SYSTEM, "item": "x", "target": "a", "weight": "high"}, "weight", "finite number"),
    ({"system": SYSTEM, "item": "x", "target": "a", "weight": True}, "weight", "finite number"),
    ('{"system": "S", "item": "x", "target": "a", "weight": NaN}', "weight", "NaN"),
    ('{"system": "S", "item": "x", "target": "a", "weight": 1e999}', "weight", "1e999"),
    ({"messages": CHAT_PROMPT, "chosen": "toma", "rejected": {"role": "user", "content": "x"}}, "rejected.role",
     "assistant"),
    ({"messages": CHAT_PROMPT, "chosen": [], "rejected": "x"}, "chosen", "one assistant message"),
    ({"messages": CHAT_PROMPT, "chosen": {"role": "assistant", "content": 3}, "rejected": "x"}, "chosen.content",
     "string"),
    ({"messages": CHAT_PROMPT, "chosen": {"content": "same"}, "rejected": "same"}, "rejected", "same answer"),
    ({"prefix_ids": [1], "item_ids": [2], "chosen_ids": [3], "rejected_ids": [3]}, "rejected_ids", "same answer"),
    ({"prefix_ids": [1], "item_ids": [2], "chosen_ids": [3]}, "rejected_ids", "missing"),
])
def test_bad_pairs_and_weights_name_file_line_and_field(tmp_path, row, field, words):
    good = {"system": SYSTEM, "item": "y", "target": "z"} if "system" in str(row) or "messages" in str(row) \
        else {"prefix_ids": [1], "item_ids": [2], "target_ids": [3]}
    if "messages" in str(row):
        good = {"messages": [*CHAT_PROMPT, {"role": "assistant", "content": "z"}]}
    if "chosen" in str(row) or "rejected" in str(row):  # a file of pairs: the good line is a pair too
        good = {k: v for k, v in good.items() if k not in ("target", "target_ids")}
        good |= ({"chosen_ids": [4], "rejected_ids": [5]} if "prefix_ids" in good else {"chosen": "u", "rejected": "v"})
        if "messages" in good:
            good["messages"] = CHAT_PROMPT
    path = write(tmp_path, [good, row])
    with pytest.raises(DataError) as e:
        load_examples(path, vocab_size=50)
    assert (e.value.source, e.value.line, e.value.field) == (str(path), 2, field)
    assert words in str(e.value)


def test_pairs_train_their_last_turn_only(tmp_path):
    path = write(tmp_path, [{"messages": CHAT_PROMPT, "chosen": "toma", "rejected": "kelu"}])
    with pytest.raises(DataError, match="train_on all is not built for pairs"):
        load_examples(path, train_on="all")


def _pairs(n_prompts=3, n=40, seed=0):
    """Random pretokenized pairs (and their prompts' lengths) for the planners."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        prefix = tuple(range(1, 2 + (k % n_prompts) * 5))
        item = tuple(rng.randrange(1, 90) for _ in range(rng.randrange(0, 9)))
        common = tuple(rng.randrange(1, 90) for _ in range(rng.randrange(0, 3)))
        for side in ("chosen", "rejected"):
            answer = common + tuple(rng.randrange(1, 90) for _ in range(rng.randrange(1, 7)))
            if side == "rejected":
                answer += (95,)  # never equal to chosen
            out.append(type("Ex", (), dict(id=f"p{k}:{side}", prefix_ids=prefix, item_ids=item, target_ids=answer,
                                           pair=f"p{k}", side=side, images=(), spans=(), weight=1.0))())
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("planner", ["flat", "tree"])
@pytest.mark.parametrize("budget,most", [(40, 3), (60, 5), (31, 2), (200, 90)])
def test_a_pairs_answers_are_always_in_one_pack(planner, budget, most):
    examples = _pairs()
    plan = (plan_packs if planner == "flat" else plan_tree_packs)(examples, budget, most, on_overflow="skip")
    where = {e: k for k, pack in enumerate(plan.packs) for e in pack.examples}
    for c, r in pair_examples(examples):
        assert (c in where) == (r in where)  # a pair is planned whole or skipped whole
        if c in where:
            assert where[c] == where[r]
        else:
            assert c in plan.skipped and r in plan.skipped
    for pack in plan.packs:  # the bounds hold: positions and continuations
        assert pack.positions <= budget and len(pack.examples) <= most
    assert sum(len(p.examples) for p in plan.packs) + len(plan.skipped) == len(examples)


def test_a_pair_over_the_budget_is_named(tmp_path):
    examples = _pairs(n=2)
    with pytest.raises(ValueError, match="preference pair needs"):
        plan_packs(examples, 12, 8)


def test_the_objective_refuses_data_it_does_not_train_on(tmp_path):
    pairs = load_examples(write(tmp_path, [{"system": SYSTEM, "item": "x", "chosen": "a", "rejected": "b"}]))
    weighted = load_examples(write(tmp_path, [{"system": SYSTEM, "item": "x", "target": "a", "weight": 0.5}], "w.jsonl"))
    plain = load_examples(write(tmp_path, [{"system": SYSTEM, "item": "x", "target": "a"}], "p.jsonl"))
    with pytest.raises(ValueError, match="set train.objective: dpo"):
        Sft().check(pairs)
    with pytest.raises(ValueError, match="set train.objective: dpo"):
        Weighted().check(pairs)
    with pytest.raises(ValueError, match="sft would ignore"):
        Sft().check(weighted)
    with pytest.raises(ValueError, match="trains on preference pairs"):
        Dpo().check(plain)
    Dpo().check(pairs), Weighted().check(weighted), Sft().check(plain)


@pytest.mark.parametrize("objective", ["dpo", "weighted"])
@pytest.mark.parametrize("packing,words", [
    ({"on_overflow": "walk"}, "on_overflow walk is not built"),
    ({"context_grad": "kv_only"}, "context_grad kv_only is not built"),
    ({"context_grad": "frozen"}, "context_grad frozen is not built"),
])
def test_the_objectives_refuse_the_walk_and_the_cut_contexts(objective, packing, words):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"train": {"objective": objective}, "packing": packing})
    assert f"train.objective {objective}: packing.{words}" in str(e.value)


def test_dpo_refuses_groups_and_single_continuation_packs():
    with pytest.raises(ConfigError, match="continuation_groups 2 is not built"):
        config_from_dict({"train": {"objective": "dpo"}, "packing": {"continuation_groups": 2}})
    with pytest.raises(ConfigError, match="max_continuations must be at least 2"):
        config_from_dict({"train": {"objective": "dpo"}, "packing": {"max_continuations": 1}})
    with pytest.raises(ConfigError, match="dpo_beta: must be positive"):
        config_from_dict({"train": {"objective": "dpo", "dpo_beta": 0}})
    config_from_dict({"train": {"objective": "weighted"}, "packing": {"continuation_groups": 2}})


@pytest.mark.parametrize("objective", ["sft", "weighted"])
def test_rpo_alpha_is_refused_outside_dpo_and_below_0(objective):
    with pytest.raises(ConfigError, match=f"train.rpo_alpha: weighs the chosen answers' cross-entropy under "
                                          f"train.objective dpo, not {objective}"):
        config_from_dict({"train": {"objective": objective, "rpo_alpha": 1.0}})
    with pytest.raises(ConfigError, match=r"train.rpo_alpha: must be >= 0 \(0: DPO alone\), got -0.5"):
        config_from_dict({"train": {"objective": "dpo", "rpo_alpha": -0.5}})
    with pytest.raises(ConfigError, match="train.rpo_alpha"):
        config_from_dict({"train": {"objective": "dpo", "rpo_alpha": float("nan")}})
    assert config_from_dict({"train": {"objective": "dpo", "rpo_alpha": 1.0}}).train.rpo_alpha == 1.0


def test_a_tree_plans_shared_prefix_figures_plan_the_pairs_flat():
    examples = _pairs(n=60)
    tree = plan_tree_packs(examples, 90, 6, on_overflow="skip")
    planned = [examples[i] for pack in tree.packs for i in pack.examples]
    flat = plan_packs(planned, 90, 6, on_overflow="skip")
    assert tree.figures["packs_shared_prefix"] == len(flat.packs)
    assert tree.figures["positions_shared_prefix"] == sum(p.positions for p in flat.packs)
    assert tree.figures["positions_shared_prefix"] > sum(p.positions for p in tree.packs)  # the item once per pair


@pytest.mark.parametrize("version", ["qwen3.5", "qwen3.6"])
def test_a_chat_pair_under_the_official_templates_is_its_two_chats(tmp_path, version):
    """Qwen's official templates (../shared/templates) and Qwen's merges: each answer of a pair, reasoning
    included, is the example its conversation gives as a plain chat (tests/data/test_chat_official.py checks those
    against the templates' own renders)."""
    from chat_data import QWEN_LIKE, official_template_path

    prompt = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "Ask."}, {"role": "user", "content": "2+2, in digits?"}]
    chosen = {"role": "assistant", "content": "4", "reasoning_content": "two and two"}
    rejected = {"role": "assistant", "content": "5"}
    template = official_template_path(version)
    pair = load_examples(write(tmp_path, [{"id": "q", "messages": prompt, "chosen": chosen, "rejected": rejected}]),
                         tokenizer=QWEN_LIKE, chat_template=template)
    chats = load_examples(write(tmp_path, [{"id": f"q:{side}", "messages": [*prompt, answer]} for side, answer in
                                           (("chosen", chosen), ("rejected", rejected))], "chats.jsonl"),
                          tokenizer=QWEN_LIKE, chat_template=template)
    assert [(e.id, e.prefix_ids, e.item_ids, e.target_ids) for e in pair] == \
        [(e.id, e.prefix_ids, e.item_ids, e.target_ids) for e in chats]
    assert [e.side for e in pair] == ["chosen", "rejected"]


@pytest.mark.parametrize("differs", ["prefix_ids", "item_ids"])
def test_a_pair_whose_answers_render_another_prompt_is_refused(differs):
    """A chat template that reads the answer into P or into the item renders the two sides' prompts apart: refused
    naming the rejected side's line and field (the item's comparison dropped went unseen: no data rendered that)."""
    from types import SimpleNamespace

    from packtrain.data.preference import check_pairs

    def side(name, **changed):
        fields = {"prefix_ids": (1, 2), "item_ids": (3, 4), "target_ids": (5,) if name == "chosen" else (6,)}
        return SimpleNamespace(pair="p", side=name, line=7 if name == "rejected" else 6, **{**fields, **changed})

    fields = {"chosen": "chosen", "rejected": "rejected"}
    errors = LineErrors()
    check_pairs([side("chosen"), side("rejected")], Path("pairs.jsonl"), fields, errors)
    errors.raise_any()
    check_pairs([side("chosen"), side("rejected", **{differs: (9, 9)})], Path("pairs.jsonl"), fields, errors)
    with pytest.raises(DataError, match="renders another prompt than chosen") as e:
        errors.raise_any()
    assert (e.value.source, e.value.line, e.value.field) == ("pairs.jsonl", 7, "rejected")


# --- TRL's preference forms: read where they map exactly onto a chat pair, else refused with the mapping ------------

ANSWERS = ([{"role": "assistant", "content": "toma"}], [{"role": "assistant", "content": "kelu"}])


def _as_loaded(examples):
    return [(e.id, e.prefix_ids, e.item_ids, e.target_ids, e.pair, e.side, e.weight) for e in examples]


def test_trls_conversational_pairs_are_packtrains_chat_pairs(tmp_path):
    """TRL's conversational form (prompt: the messages) and its implicit-prompt form (two whole conversations) give
    the examples of packtrain's own chat pair."""
    own = load_examples(write(tmp_path, [{"id": "q", "messages": CHAT_PROMPT, "chosen": "toma", "rejected": "kelu",
                                          "weight": 2.0}], "own.jsonl"))
    chosen, rejected = ANSWERS
    trl = {"id": "q", "prompt": CHAT_PROMPT, "chosen": chosen, "rejected": rejected, "weight": 2.0}
    implicit = {"id": "q", "chosen": CHAT_PROMPT + chosen, "rejected": CHAT_PROMPT + rejected, "weight": 2.0}
    for name, row in (("trl.jsonl", trl), ("implicit.jsonl", implicit)):
        assert _as_loaded(load_examples(write(tmp_path, [row], name))) == _as_loaded(own), name


@pytest.mark.parametrize("row,field,words", [
    ({"prompt": "code of falcon?", "chosen": "toma", "rejected": "kelu"}, "prompt",
     "rename prompt to item and give the system prompt as system"),
    ({"prompt": CHAT_PROMPT[1:], "chosen": ANSWERS[0], "rejected": ANSWERS[1]}, "prompt[0]",
     'put {"role": "system", "content": ...} first'),
    ({"chosen": "code of falcon? toma", "rejected": "code of falcon? kelu"}, "chosen",
     "give the system prompt as system, the request as item, and only the two answers as chosen and rejected"),
    ({"chosen": CHAT_PROMPT[1:] + ANSWERS[0], "rejected": CHAT_PROMPT[1:] + ANSWERS[1]}, "chosen[0]",
     'put {"role": "system", "content": ...} first'),
    ({"chosen": CHAT_PROMPT + ANSWERS[0], "rejected": [CHAT_PROMPT[0], {"role": "user", "content": "?"}, *ANSWERS[1]]},
     "rejected[1]", "give the shared turns as messages and the two answers as chosen and rejected"),
    ({"chosen": CHAT_PROMPT + ANSWERS[0], "rejected": CHAT_PROMPT + ANSWERS[1] * 2}, "rejected[2]",
     "the same up to their last message"),
    # a problem inside a converted record is named as the file names it
    ({"prompt": [CHAT_PROMPT[0], {"role": "user", "content": 3}], "chosen": ANSWERS[0], "rejected": ANSWERS[1]},
     "prompt[1].content", "expected a string"),
    ({"chosen": CHAT_PROMPT + ANSWERS[0], "rejected": CHAT_PROMPT + [{"role": "assistant", "content": 3}]},
     "rejected[2].content", "expected a string"),
    ({"chosen": CHAT_PROMPT + ANSWERS[0], "rejected": CHAT_PROMPT + [{"role": "user", "content": "x"}]},
     "rejected[2].role", "an answer is an assistant message"),
])
def test_trl_forms_that_do_not_map_are_refused_with_the_mapping(tmp_path, row, field, words):
    path = write(tmp_path, [{"id": "ok", "prompt": CHAT_PROMPT, "chosen": ANSWERS[0], "rejected": ANSWERS[1]}, row])
    with pytest.raises(DataError) as e:
        load_examples(path)
    assert (e.value.line, e.value.field) == (2, field), str(e.value)
    assert words in str(e.value)


def test_trls_prompt_completion_form_names_the_text_format(tmp_path):
    with pytest.raises(DataError, match="TRL's prompt-completion form is packtrain's text format: system"):
        load_examples(write(tmp_path, [{"prompt": "code of falcon?", "completion": "toma"}]))
