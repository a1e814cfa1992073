"""Scoring generated predictions (packtrain/run/scoring.py) as literal tables: thinking stripped, the exact and json
metrics on hand-worked cases, user scorers loaded from a folder and every way they fail, the summary, the first
difference and the Markdown error report."""

import ast
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from packtrain.run import scoring
from packtrain.run.scoring import (
    Scorer,
    ScorerError,
    errors_markdown,
    first_difference,
    load_scorer,
    strip_thinking,
    summarize,
)

EX = SimpleNamespace(id="ex-7")


@pytest.fixture(autouse=True)
def _forget_user_modules(tmp_path):
    """Each test's scorer modules are new: drop those imported from its tmp_path (sys.modules would keep them)."""
    yield
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def write_module(folder: Path, name: str, body: str) -> Path:
    path = folder / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


def test_the_module_imports_only_the_standard_library():
    tree = ast.parse(Path(scoring.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"__future__"} <= set(sys.stdlib_module_names), names


@pytest.mark.parametrize("text, expected", [
    ("<think>plan\nmore</think>\n  answer", "answer"),
    ("before <think>x</think> after", "before after"),
    ("<think>a</think>one <think>b\n</think>two", "one two"),
    ("answer<think>still thinking", "answer"),
    ("<think>only thinking", ""),
    ("reasoning\n</think>\n\nanswer", "answer"),  # the chat template opened the block in the prompt
    ("r</think> x <think>y</think>z", "x z"),
    ("<think>a</think>b<think>c", "b"),
    ("plain  ", "plain  "),
])
def test_strip_thinking(text, expected):
    assert strip_thinking(text) == expected


@pytest.mark.parametrize("prediction, target, expected", [
    ("  42\n", "42", 1.0),
    ("42", "\n42  ", 1.0),
    ("4 2", "42", 0.0),
    ("43", "42", 0.0),
])
def test_exact_ignores_surrounding_whitespace_only(prediction, target, expected):
    assert load_scorer("exact").score(prediction, target, EX) == (expected, True)


TARGET = '{"a": 1, "b": {"c": [1, 2]}, "d": true}'  # leaves: a, b.c[0], b.c[1], d


@pytest.mark.parametrize("prediction, target, expected", [
    ('{"a": 1, "b": {"c": [1, 3]}}', TARGET, 0.5),  # b.c[1] wrong, d missing: 2 of 4
    ('{"a": 1, "b": {"c": [1, 2], "z": 0}, "d": true, "e": 5}', TARGET, 1.0),  # extra fields do not count
    ('{"a": 1, "b": {"c": [1]}, "d": false}', TARGET, 0.5),  # b.c[1] missing, d wrong
    ('{"a": 1, "b": [1, 2], "d": true}', TARGET, 0.5),  # b is a list: neither b.c leaf is there
    ('[1, 2, 3]', TARGET, 0.0),
    ('[1, 2]', '[1, 2, 3]', 2 / 3),
    ('{"x": 1, "y": 1.0}', '{"x": true, "y": 1}', 0.5),  # true is not 1; 1.0 is 1
    ("1", "true", 0.0),
    ("0", "false", 0.0),
    ("1.0", "1", 1.0),
    ('"1"', "1", 0.0),
    ("null", "null", 1.0),
    ("0", "null", 0.0),
    ('"yes"', '"yes"', 1.0),
    ('"no"', '"yes"', 0.0),
    ("{}", "{}", 1.0),
    ('{"a": 1}', "{}", 0.0),
    ("[]", "[]", 1.0),
    ("{}", "[]", 0.0),
    ('{"a": {}, "b": 2}', '{"a": {}, "b": 1}', 0.5),  # an empty container is a leaf of its own
    ('{"a": {"x": 1}, "b": 1}', '{"a": {}, "b": 1}', 0.5),
    ('{"a": [true, 1]}', '{"a": [1, true]}', 0.0),
])
def test_json_scores_the_fraction_of_target_leaves(prediction, target, expected):
    assert load_scorer("json").score(prediction, target, EX) == (expected, True)


@pytest.mark.parametrize("prediction", [
    '```json\n{"a": 1, "b": [2]}\n```',
    '  ```\n{"a": 1, "b": [2]}\n```\n',
    '```JSON {"a": 1, "b": [2]} ```',
])
def test_json_reads_a_prediction_in_one_code_fence(prediction):
    assert load_scorer("json").score(prediction, '{"a": 1, "b": [2]}', EX) == (1.0, True)


@pytest.mark.parametrize("prediction", [
    "not json",
    '{"a": 1',
    'Here it is: ```json\n{"a": 1}\n```',
    "```python\n{'a': 1}\n```",
    "",
])
def test_json_an_unparsable_prediction_scores_zero_unparsed(prediction):
    assert load_scorer("json").score(prediction, '{"a": 1}', EX) == (0.0, False)


def test_json_an_unparsable_target_is_a_data_error():
    with pytest.raises(ScorerError, match=r"example ex-7: the target is not JSON"):
        load_scorer("json").score('{"a": 1}', "{a: 1}", EX)


def test_a_user_scorer_is_loaded_from_the_search_dirs(tmp_path):
    write_module(tmp_path, "myscorer", "def score(prediction, target, example):\n"
                                       "    return 1.0 if (prediction, target, example.id) == ('p', 't', 'e1') "
                                       "else 0.25\n")
    saved = list(sys.path)
    scorer = load_scorer("python:myscorer:score", [tmp_path])
    assert sys.path == saved
    assert "myscorer" in sys.modules
    assert scorer.spec == "python:myscorer:score"
    assert scorer.score("p", "t", SimpleNamespace(id="e1")) == (1.0, True)
    assert scorer.score("p", "other", SimpleNamespace(id="e1")) == (0.25, True)


def test_the_search_dirs_come_first_in_their_order(tmp_path, monkeypatch):
    for folder, value in (("a", 0.125), ("b", 0.75), ("on_sys_path", 0.5)):
        write_module(tmp_path / folder, "ordered_scorer", f"def score(p, t, e):\n    return {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "on_sys_path"))
    assert load_scorer("python:ordered_scorer:score", [tmp_path / "a", tmp_path / "b"]).score("", "", EX)[0] == 0.125


def test_a_user_scorer_in_a_package(tmp_path):
    write_module(tmp_path / "pkgscore", "__init__", "")
    write_module(tmp_path / "pkgscore", "mod", "def fn(p, t, e):\n    return p == t\n")
    scorer = load_scorer("python:pkgscore.mod:fn", [str(tmp_path)])
    assert scorer.score("x", "x", EX) == (1.0, True)  # a bool is 1.0 or 0.0
    assert type(scorer.score("x", "x", EX)[0]) is float
    assert scorer.score("x", "y", EX) == (0.0, True)


def test_a_scorer_that_raises_names_the_spec_and_the_example(tmp_path):
    write_module(tmp_path, "raiser", "def score(p, t, e):\n    raise KeyError('label')\n")
    with pytest.raises(ScorerError) as info:
        load_scorer("python:raiser:score", [tmp_path]).score("p", "t", SimpleNamespace(id="e3"))
    assert str(info.value) == "generate.metric python:raiser:score: the scorer raised KeyError: 'label' on example e3"
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("returned, shown", [
    ("1.5", "1.5"), ("-0.25", "-0.25"), ("float('nan')", "nan"), ("float('inf')", "inf"), ("'0.5'", "'0.5'"),
    ("None", "None"), ("[1.0]", "[1.0]"),
])
def test_a_scorer_must_return_a_finite_number_in_0_1(tmp_path, returned, shown):
    write_module(tmp_path, "badret", f"def score(p, t, e):\n    return {returned}\n")
    scorer = load_scorer("python:badret:score", [tmp_path])
    with pytest.raises(ScorerError) as info:
        scorer.score("p", "t", SimpleNamespace(id="e9"))
    message = str(info.value)
    assert message.startswith("generate.metric python:badret:score: the scorer returned ")
    assert f"returned {shown} " in message and "on example e9" in message


@pytest.mark.parametrize("spec", ["python:", "python:mod", "python:mod:", "python::fn", "python:a:b:c", "bogus", "",
                                  "Exact"])
def test_a_malformed_spec_is_refused(spec):
    with pytest.raises(ScorerError) as info:
        load_scorer(spec)
    assert str(info.value).startswith(f"generate.metric: {spec!r} ")


def test_an_unknown_metric_lists_the_choices():
    with pytest.raises(ScorerError, match=r"'bogus' is not a metric; choose one of exact, json, python:"):
        load_scorer("bogus")


@pytest.mark.parametrize("spec", ["python:no_such_scorer_module:score", "python:no_such_scorer_pkg.mod:score"])
def test_a_missing_module_is_refused_and_sys_path_restored(tmp_path, spec):
    saved = list(sys.path)
    with pytest.raises(ScorerError) as info:
        load_scorer(spec, [tmp_path])
    assert sys.path == saved
    message = str(info.value)
    assert message.startswith(f"generate.metric: {spec!r}: module ") and "not found" in message
    assert str(tmp_path) in message


@pytest.mark.parametrize("body, shown", [
    ("import no_such_dependency_of_a_scorer\n", "raised ModuleNotFoundError: No module named"),
    ("raise RuntimeError('boom')\n", "raised RuntimeError: boom"),
    ("def score(:\n", "raised SyntaxError"),
])
def test_a_module_whose_import_fails_is_refused(tmp_path, body, shown):
    write_module(tmp_path, "broken_scorer", body)
    saved = list(sys.path)
    with pytest.raises(ScorerError) as info:
        load_scorer("python:broken_scorer:score", [tmp_path])
    assert sys.path == saved
    assert str(info.value).startswith("generate.metric: 'python:broken_scorer:score': importing broken_scorer ")
    assert shown in str(info.value)


def test_a_missing_function_is_refused(tmp_path):
    write_module(tmp_path, "has_score", "def score(p, t, e):\n    return 1\n")
    with pytest.raises(ScorerError, match=r"^generate\.metric: 'python:has_score:other': .* has no other$"):
        load_scorer("python:has_score:other", [tmp_path])


def test_a_non_callable_attribute_is_refused(tmp_path):
    write_module(tmp_path, "not_callable", "score = 3\n")
    with pytest.raises(ScorerError, match=r"^generate\.metric: 'python:not_callable:score': not_callable\.score is "
                                          r"not callable \(it is a int\)$"):
        load_scorer("python:not_callable:score", [tmp_path])


def test_builtin_scorers_compare_by_spec():
    assert load_scorer("exact") == Scorer("exact")
    assert load_scorer("json") != load_scorer("exact")


def test_summarize():
    rows = [{"match": True, "score": 1.0}, {"match": False, "score": 0.5, "parsed": True},
            {"match": False, "score": 0.0, "parsed": False}, {"match": True, "score": 1.0}]
    assert summarize(rows) == {"examples": 4, "exact": 2, "exact_match": 0.5, "mean_score": 0.625, "unparsed": 1}
    assert summarize([]) == {"examples": 0, "exact": 0, "exact_match": None, "mean_score": None, "unparsed": 0}


@pytest.mark.parametrize("a, b, expected", [
    ("abc", "abc", None), ("abc", "abd", 2), ("abc", "ab", 2), ("ab", "abc", 2), ("", "", None), ("", "x", 0),
    ("x", "y", 0), ([1, 2, 3], [1, 5, 3], 1), ([1, 2], [1, 2], None), ([4], [], 0),
])
def test_first_difference(a, b, expected):
    assert first_difference(a, b) == expected


PROMPTS = {0: "You are a grader.\nAnswer   briefly.", 1: "Q" * 400}
ROWS = [
    {"id": "a1", "prompt": 0, "match": True, "score": 1.0, "item": "2+2", "target": "4", "prediction": "4"},
    {"id": "b1", "prompt": 1, "match": False, "score": 0.0, "item": "spell", "target": "hello world\n",
     "prediction": "hello there ```` code", "target_ids": [5, 6, 7, 8], "prediction_ids": [5, 6, 9]},
    {"id": "a2", "prompt": 0, "match": False, "score": 0.0, "item": "8+8", "target": "16",
     "prediction": "<think>hmm</think>17", "scored": "17"},
    {"id": "b2", "prompt": 1, "match": False, "score": 0.0, "item_ids": [1, 2], "target_ids": [3, 4],
     "prediction_ids": [3, 5]},
    {"id": "b3", "prompt": 1, "match": True, "score": 1.0, "item": "x", "target": "y", "prediction": "y"},
]


def test_errors_markdown_groups_mismatches_by_prompt():
    md = errors_markdown(ROWS, PROMPTS, "Eval errors")
    assert md.startswith("# Eval errors\n\nexact 2/5, mean score 0.400\n")
    p0, a2 = md.index("## Prompt 0: 1 of 2 examples mismatched"), md.index("### a2: score 0.000")
    p1, b1, b2 = (md.index("## Prompt 1: 2 of 3 examples mismatched"), md.index("### b1: score 0.000"),
                  md.index("### b2: score 0.000"))
    assert p0 < a2 < p1 < b1 < b2
    assert "### a1" not in md and "### b3" not in md
    assert "```\nYou are a grader. Answer briefly.\n```" in md
    assert "Q" * 300 + " …" in md and "Q" * 301 not in md


def test_errors_markdown_shows_each_mismatch():
    md = errors_markdown(ROWS, PROMPTS, "Eval errors")
    a2 = md[md.index("### a2"):md.index("## Prompt 1")]
    assert "first difference at character 1\n" in a2  # "16" against the scored "17", not against "<think>"
    assert "item:\n```\n8+8\n```" in a2 and "target:\n```\n16\n```" in a2
    assert "prediction:\n```\n<think>hmm</think>17\n```" in a2 and "scored:\n```\n17\n```" in a2
    b1 = md[md.index("### b1"):md.index("### b2")]
    assert "first difference at character 6, token 2\n" in b1
    assert "prediction:\n`````\nhello there ```` code\n`````" in b1  # the fence outruns the backticks inside
    assert "scored:" not in b1
    b2 = md[md.index("### b2"):]
    assert "\ntoken 1\n" in b2  # no text: the ids only
    assert "item_ids:\n```\n[1, 2]\n```" in b2 and "target_ids:\n```\n[3, 4]\n```" in b2
    assert "prediction_ids:\n```\n[3, 5]\n```" in b2


def test_errors_markdown_reports_by_match_not_by_score():
    rows = [{"id": "j1", "prompt": 0, "match": False, "score": 1.0, "target": '{"a": 1}', "prediction": '{"a":1}'},
            {"id": "j2", "prompt": 0, "match": True, "score": 0.5, "target": "x", "prediction": "x"}]
    md = errors_markdown(rows, {0: "P"}, "T")
    assert "### j1: score 1.000\n\nfirst difference at character 5\n" in md and "### j2" not in md


def test_errors_markdown_without_mismatches():
    rows = [r for r in ROWS if r["match"]]
    assert errors_markdown(rows, PROMPTS, "T") == "# T\n\nexact 2/2, mean score 1.000\n\nNo mismatches.\n"
    assert errors_markdown([], {}, "T") == "# T\n\nexact 0/0, mean score n/a\n\nNo mismatches.\n"
