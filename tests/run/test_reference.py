"""dpo's precomputed reference (packtrain.run.reference): the digests see a change of the data, the base and the
tokenizer, and a cache computed from others is refused, naming what changed."""

import json
import shutil
from pathlib import Path

import pytest

from packtrain.config import config_from_dict
from packtrain.data.examples import BUNDLED_TOKENIZER, load_examples
from packtrain.run import reference

SYSTEM = "You are terse."


def _data(tmp_path, answer="toma"):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "a", "system": SYSTEM, "item": "x", "chosen": answer, "rejected": "kelu"}) + "\n")
    return load_examples(path)


def test_the_digests_see_each_change(tmp_path):
    cfg = config_from_dict({"model": {"config": {"model_type": "qwen3_5_text", "hidden_size": 8}}})
    base = reference.digests(cfg, _data(tmp_path))
    assert reference.digests(cfg, _data(tmp_path)) == base  # the same inputs, the same digests
    assert reference.digests(cfg, _data(tmp_path, "tomas"))["data"] != base["data"]
    reseeded = config_from_dict({"model": {"config": {"model_type": "qwen3_5_text", "hidden_size": 8}, "seed": 1}})
    assert reference.digests(reseeded, _data(tmp_path))["base"] != base["base"]
    tok = tmp_path / "tok"
    shutil.copytree(BUNDLED_TOKENIZER, tok)
    other = config_from_dict({"model": {"config": {"model_type": "qwen3_5_text", "hidden_size": 8}},
                              "data": {"tokenizer": str(tok)}})
    assert reference.digests(other, _data(tmp_path))["tokenizer"] == base["tokenizer"]  # a copy is the same
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages }}"
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    assert reference.digests(other, _data(tmp_path))["tokenizer"] != base["tokenizer"]


def test_a_checkpoints_weights_are_in_the_base_digest(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(bytes(300_000))
    cfg = config_from_dict({"model": {"path": str(model)}})
    before = reference.base_digest(cfg)
    shutil.copytree(model, tmp_path / "copy")
    assert reference.base_digest(config_from_dict({"model": {"path": str(tmp_path / "copy")}})) == before
    raw = bytearray(300_000)
    raw[150_000] = 1  # one byte in the middle of the file
    (model / "model.safetensors").write_bytes(bytes(raw))
    assert reference.base_digest(cfg) != before


def test_the_cache_round_trips_and_refuses_other_inputs(tmp_path):
    digests = {"data": "d1", "base": "b1", "tokenizer": "t1"}
    table = {"a:chosen": -1.0 / 3.0, "a:rejected": -12.345678901234567}
    assert reference.read(tmp_path, digests) is None
    reference.write(tmp_path, digests, table)
    assert reference.read(tmp_path, digests) == table  # bit for bit
    for name, words in [("data", "training data"), ("base", "base model"), ("tokenizer", "tokenizer")]:
        with pytest.raises(ValueError, match=f"another {words}.*remove reference.json"):
            reference.read(tmp_path, {**digests, name: "changed"})
    Path(tmp_path / reference.FILE).write_text("{not json")
    with pytest.raises(ValueError, match="unreadable DPO reference cache"):
        reference.read(tmp_path, digests)
