"""A command's setup before the model (packtrain/run/session.py), on pretokenized data without a model: the splits
read and planned, a split that is not set, ``n_groups`` in place of the config's groups, images refused under
continuation groups only where the kinds run them, and the config the model is assembled with."""

import json
from types import SimpleNamespace

import pytest

from packtrain.config import config_from_dict
from packtrain.run.session import _check_images, open_session
from packtrain.run.units import Kinds, plan_for


def _data(path, n, offset=0):
    rows = [{"id": f"x{i + offset}", "prefix_ids": [3, 4, 5 + i % 2], "item_ids": [9] * (1 + i % 2),
             "target_ids": [7, 8]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(tmp_path, eval_rows=2, **packing):
    data = {"train": _data(tmp_path / "train.jsonl", 5), "format": "pretokenized",
            "eval": _data(tmp_path / "eval.jsonl", eval_rows, offset=10) if eval_rows else None}
    return config_from_dict({"data": data, "packing": {"token_budget": 64, "max_continuations": 2, **packing}},
                            base_dir=str(tmp_path))


def test_the_split_and_data_eval_are_read_and_each_planned(tmp_path):
    cfg = _cfg(tmp_path)
    session = open_session(cfg, None, with_eval=True, savings=False, model=False)
    assert [ex.id for ex in session.examples] == [f"x{i}" for i in range(5)]
    assert [ex.id for ex in session.eval_examples] == ["x10", "x11"]
    assert session.plan == plan_for(cfg, session.examples)
    assert session.eval_plan == plan_for(cfg, session.eval_examples)
    assert [ex.id for ex in session.all_examples] == [f"x{i}" for i in range(5)] + ["x10", "x11"]
    assert session.choice is None and session.run_cfg is cfg  # nothing chosen: the user's config as it is
    alone = open_session(cfg, None, split="eval", savings=False, model=False)
    assert [ex.id for ex in alone.examples] == ["x10", "x11"] and alone.eval_examples is None


def test_a_split_that_is_not_set_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"^data\.eval: not set$"):
        open_session(_cfg(tmp_path, eval_rows=0), None, split="eval", savings=False, model=False)


def test_n_groups_replaces_the_configs_continuation_groups(tmp_path):
    cfg = _cfg(tmp_path, continuation_groups=2)
    assert open_session(cfg, None, savings=False, model=False).kinds.n_groups == 2
    assert open_session(cfg, None, savings=False, model=False, n_groups=1).kinds.n_groups == 1


def test_the_model_is_assembled_with_the_chosen_savings(tmp_path):
    session = open_session(_cfg(tmp_path), None, savings=False, model=False)
    session.choice = SimpleNamespace(apply=lambda cfg: ("applied to", cfg))
    assert session.run_cfg == ("applied to", session.cfg)


def test_images_are_refused_under_groups_naming_the_first_example_that_has_one():
    cfg = config_from_dict({"packing": {"continuation_groups": 2}})
    examples = [SimpleNamespace(source="a.jsonl:1", images=()), SimpleNamespace(source="a.jsonl:2", images=("i",)),
                SimpleNamespace(source="a.jsonl:3", images=("j",))]
    with pytest.raises(ValueError, match=r"^a\.jsonl:2: has images, and packing\.continuation_groups > 1 takes"):
        _check_images(cfg, Kinds.of(cfg), examples)
    _check_images(cfg, Kinds.of(cfg), examples[:1])  # text only
    _check_images(cfg, Kinds.of(cfg, n_groups=1), examples)  # an evaluation runs whole packs: images are fine
