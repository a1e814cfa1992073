"""The task metric around generation (packtrain/run/task.py), without a model: each example's row from its generated
ids (target cut at its first stop token, ids compared without a tokenizer, texts scored with thinking stripped), its
public JSON line, the summary and its sentence, the positions check at its boundary, and the files written."""

import json
from types import SimpleNamespace

import pytest

from packtrain.config import config_from_dict
from packtrain.run import task as task_module
from packtrain.run.generate import Generated, GenerateSpec
from packtrain.run.scoring import Scorer, ScorerError, check_text
from packtrain.run.session import task_tokenizer
from packtrain.run.task import (
    Task,
    check_positions,
    describe,
    errors_path_for,
    public_row,
    run_task,
    score_row,
    write_task,
)

WORDS = {1: "<think>", 2: "hm", 3: "</think>", 4: " A", 5: "B", 0: "<eos>"}


class Words:
    """A tokenizer that decodes each id to a word of ``WORDS``."""

    def decode(self, ids):
        return "".join(WORDS[i] for i in ids)


def _example(id_, item, target):
    return SimpleNamespace(id=id_, item_ids=tuple(item), target_ids=tuple(target))


def _task(examples, tokenizer=None, strip=False, prompts=((7, 8),), packs=None, skipped=()):
    plan = SimpleNamespace(prompts=[list(p) for p in prompts], skipped=list(skipped),
                           packs=packs or [SimpleNamespace(prompt=0, examples=list(range(len(examples))))])
    return Task(plan, examples, GenerateSpec(8, frozenset({0})), Scorer("exact"), strip, tokenizer)


def test_without_a_tokenizer_the_ids_up_to_the_first_stop_token_are_compared():
    task = _task([_example("a", [9], [5, 4, 0, 5])])  # the target ends at its first stop token (0)
    hit = score_row(task, 0, 0, Generated((5, 4), "eos"))
    miss = score_row(task, 0, 0, Generated((5, 4, 5), "length"))
    assert (hit["target_ids"], hit["score"], hit["match"], hit["stop"]) == ([5, 4], 1.0, True, "eos")
    assert (miss["score"], miss["match"], miss["stop"]) == (0.0, False, "length")
    assert public_row(hit) == {"id": "a", "prediction_ids": [5, 4], "stop": "eos", "score": 1.0, "match": True}


@pytest.mark.parametrize("strip", [True, False])
def test_texts_are_scored_with_thinking_stripped_from_both_sides_when_asked(strip):
    task = _task([_example("a", [5], [4, 0])], tokenizer=Words(), strip=strip)
    row = score_row(task, 0, 0, Generated((1, 2, 3, 4), "eos"))
    assert (row["prediction"], row["target"], row["item"]) == ("<think>hm</think> A", " A", "B")
    assert row["scored"] == ("A" if strip else "<think>hm</think> A")
    assert (row["score"], row["match"]) == ((1.0, True) if strip else (0.0, False))


def test_a_public_line_holds_the_documented_keys_and_says_when_json_did_not_parse():
    row = {"id": "a", "prediction_ids": [1], "prediction": "x", "target": "y", "stop": "eos", "score": 0.0,
           "match": False, "prompt": 0, "item": "i", "scored": "x", "item_ids": [2], "target_ids": [3]}
    assert public_row({**row, "parsed": True}) == {k: row[k] for k in task_module.PUBLIC}
    assert public_row({**row, "parsed": False}) == {**{k: row[k] for k in task_module.PUBLIC}, "parsed": False}


def test_the_summary_counts_each_prediction_and_its_stop_token(monkeypatch):
    """Tokens generated: each prediction's ids, and the stop token of those that stopped on one."""
    examples = [_example(f"e{i}", [9], [5, 0]) for i in range(3)]
    packs = [SimpleNamespace(prompt=1, examples=[0, 2]), SimpleNamespace(prompt=0, examples=[1])]
    task = _task(examples, prompts=((7,), (8,)), packs=packs, skipped=[3])
    generated = {0: Generated((5,), "eos"), 1: Generated((4, 4, 4), "length"), 2: Generated((5,), "length")}
    monkeypatch.setattr(task_module, "generate", lambda *a, **k: generated)
    result = run_task(None, task, None, None)
    assert [(r["id"], r["prompt"], r["match"]) for r in result.rows] == [("e0", 1, True), ("e1", 0, False),
                                                                         ("e2", 1, True)]
    s = result.summary
    assert (s["examples"], s["exact"], s["skipped"], s["tokens"]) == (3, 2, 1, 1 + 1 + 3 + 1)
    assert s["mean_score"] == pytest.approx(2 / 3)


def test_the_summary_sentence_names_only_the_counts_there_are():
    plain = {"examples": 4, "exact": 3, "mean_score": 0.8125, "unparsed": 0, "skipped": 0}
    assert describe(plain) == "exact match 3/4, mean score 0.8125"
    assert describe({**plain, "unparsed": 2, "skipped": 1}) == ("exact match 3/4, mean score 0.8125, 2 predictions "
                                                                "not JSON, 1 examples over the token budget not "
                                                                "generated")
    assert describe({**plain, "unparsed": 2}) == "exact match 3/4, mean score 0.8125, 2 predictions not JSON"
    assert describe({"examples": 0, "exact": 0, "mean_score": None}) == "exact match 0/0"


def test_only_the_exact_metric_works_without_a_tokenizer():
    check_text(Scorer("exact"), None)
    check_text(Scorer("json"), Words())
    for spec in ("json", "python:mine:score"):
        with pytest.raises(ScorerError, match=f"{spec!r} scores text, and there is no tokenizer"):
            check_text(Scorer(spec), None)


def test_the_longest_prompt_and_item_plus_the_new_tokens_must_fit_the_models_positions():
    """P of 10 tokens and items of 3 and 5: 15 positions before the first new token, so 49 new tokens fit 64."""
    text = SimpleNamespace(max_position_embeddings=64)
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))
    plan = SimpleNamespace(prompts=[[1] * 10, [1] * 2], packs=[SimpleNamespace(prompt=0, examples=[0, 1]),
                                                               SimpleNamespace(prompt=1, examples=[2])])
    examples = [_example("a", [2] * 3, [3]), _example("b", [2] * 5, [3]), _example("c", [2] * 12, [3])]
    check_positions(model, plan, examples, 49)
    with pytest.raises(ValueError, match=r"50 new tokens after a prompt of up to 15 tokens exceed the model's 64 "
                                         r"positions \(max_position_embeddings\); at most 49 fit"):
        check_positions(model, plan, examples, 50)
    text.max_position_embeddings = None  # a config without the field: nothing to check against
    check_positions(model, plan, examples, 10**9)


def test_the_lines_and_the_error_report_are_written_and_no_temporary_file_is_left(tmp_path):
    task = _task([_example("a", [5], [4, 0]), _example("b", [5], [5, 0])], tokenizer=Words(), prompts=((4, 5),))
    rows = [score_row(task, 0, 0, Generated((4,), "eos")), score_row(task, 1, 0, Generated((4,), "eos"))]
    lines = tmp_path / "generations" / "step-3.jsonl"
    errors = errors_path_for(lines)
    assert errors == tmp_path / "generations" / "step-3.errors.md"
    write_task(task_module.TaskResult(rows, {}), lines, errors, task, "step 3")
    assert [json.loads(x) for x in lines.read_text().splitlines()] == [public_row(r) for r in rows]
    report = errors.read_text()
    assert report.startswith("# step 3\n") and "## Prompt 0: 1 of 2 examples mismatched" in report
    assert "```\nAB\n```" in report and "### b:" in report and "### a:" not in report  # P decoded; the mismatch
    assert sorted(p.name for p in lines.parent.iterdir()) == ["step-3.errors.md", "step-3.jsonl"]


def test_pretokenized_data_without_a_tokenizer_directory_has_no_tokenizer(tmp_path):
    cfg = config_from_dict({"data": {"tokenizer": str(tmp_path)}}, base_dir=str(tmp_path))
    assert task_tokenizer(cfg, "pretokenized") is None
