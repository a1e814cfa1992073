"""The typed config machinery on a small schema of its own: YAML read as 1.2 reads floats, a key given twice refused
naming both lines, values checked and coerced by type, every problem collected with its dotted path, ``--set``
overrides, and the JSON-object reader. The packtrain schema itself: tests/test_config.py."""

import dataclasses
import json
from typing import Literal

import pytest
import yaml

from packtrain.config.typed import (
    ConfigError,
    apply_overrides,
    build,
    check_value,
    get_dotted,
    load_yaml,
    parse_override,
    read_json_object,
    type_name,
    yaml_problem,
)


@dataclasses.dataclass
class Inner:
    rate: float = 0.5
    mode: Literal["a", "b"] = "a"
    sizes: list[int] = dataclasses.field(default_factory=lambda: [1])


@dataclasses.dataclass
class Outer:
    name: str | None = None
    steps: int = 1
    inner: Inner = dataclasses.field(default_factory=Inner)
    cache: int = dataclasses.field(default=0, metadata={"internal": True})


def test_exponents_read_as_floats_as_yaml_1_2_reads_them():
    raw = load_yaml("a: 1e-4\nb: 2E3\nc: -1.5e+2\nd: '1e-4'\ne: 1e4x\nf: 3\n")
    assert raw == {"a": 0.0001, "b": 2000.0, "c": -150.0, "d": "1e-4", "e": "1e4x", "f": 3}
    assert [type(raw[k]) for k in "abcf"] == [float, float, float, int]


def test_a_key_given_twice_is_refused_naming_both_lines():
    with pytest.raises(yaml.YAMLError) as e:
        load_yaml("a: 1\nb:\n  x: 1\n  y: 2\n  x: 3\n")
    assert yaml_problem(e.value) == "line 5, column 3: duplicate key 'x' (first on line 3): each key may appear once " \
                                    "in a mapping (merge the two blocks)"
    assert load_yaml("a: {x: 1}\nb: {x: 2}\n") == {"a": {"x": 1}, "b": {"x": 2}}  # one key per mapping is fine


def test_yaml_problem_counts_lines_and_columns_from_one():
    with pytest.raises(yaml.YAMLError) as e:
        load_yaml("a: 1\nb: [1, 2\n")
    assert yaml_problem(e.value).startswith("line 3, column 1: expected ',' or ']'")


@pytest.mark.parametrize("value, tp, expected", [
    (1, float, (True, 1.0)), (True, float, (False, True)), (True, int, (False, True)), (2, int, (True, 2)),
    (2.0, int, (False, 2.0)), ("b", Literal["a", "b"], (True, "b")), ("c", Literal["a", "b"], (False, "c")),
    (None, int | None, (True, None)), (0, int | None, (True, 0)), ("x", int | None, (False, "x")),
    ([1, 2], list[float], (True, [1.0, 2.0])), ([1, "a"], list[int], (False, [1, "a"])), ((1,), list[int], (False, (1,))),
    ({}, dict, (True, {})), (1, str, (False, 1)),
])
def test_values_are_checked_and_coerced_by_type(value, tp, expected):
    ok, coerced = check_value(value, tp)
    assert (ok, coerced) == expected and type(coerced) is type(expected[1])
    if isinstance(coerced, list):
        assert list(map(type, coerced)) == list(map(type, expected[1]))


def test_an_unsupported_type_is_a_programming_error():
    with pytest.raises(TypeError, match="unsupported config type"):
        check_value(1, complex)


def test_type_names_read_as_the_problems_print_them():
    assert type_name(Literal["a", "b"] | None) == "'a' | 'b' | null"
    assert type_name(list[int]) == "list of int" and type_name(float | None) == "float | null"


def test_every_problem_is_collected_with_its_dotted_path():
    problems = []
    cfg = build(Outer, {"steps": True, "nmae": "x", "cache": 3, "inner": {"rate": "fast", "mode": "b", "sizes": [2, 3]}},
                "", problems)
    assert problems == ["steps: expected int, got True", "nmae: unknown key (known: inner, name, steps)",
                        "cache: unknown key (known: inner, name, steps)", "inner.rate: expected float, got 'fast'"]
    assert (cfg.steps, cfg.inner.mode, cfg.inner.sizes, cfg.inner.rate) == (1, "b", [2, 3], 0.5)  # the rest is read
    problems = []
    assert build(Outer, {"inner": [1]}, "", problems) == Outer() and problems == ["inner: expected a mapping, got list"]
    problems = []
    assert build(Outer, None, "", problems) == Outer() and problems == []  # an empty file: every default


def test_overrides_set_nested_keys_parsed_as_yaml():
    raw = {"inner": {"rate": 0.5}, "name": "x", "steps": 4}
    out = apply_overrides(raw, ["inner.rate=1e-3", "name=", "new.deep.key=[1, 2]", "steps.sub=3"])
    # a key under a value that is no mapping replaces it (the schema then names what is wrong)
    assert out == {"inner": {"rate": 0.001}, "name": None, "new": {"deep": {"key": [1, 2]}}, "steps": {"sub": 3}}
    assert get_dotted(build(Outer, {"inner": {"rate": 2}}, "", []), "inner.rate") == 2.0
    assert parse_override(" inner.mode =b") == (["inner", "mode"], "b")


def test_malformed_overrides_are_all_listed_at_once():
    with pytest.raises(ConfigError) as e:
        apply_overrides({}, ["novalue", "a..b=1", "=1", "ok=1", "a=[1"])
    assert e.value.problems == ["--set 'novalue': expected section.key=value", "--set 'a..b=1': expected section.key=value",
                                "--set '=1': expected section.key=value", "--set 'a=[1': the value is not valid YAML"]
    assert str(e.value).startswith("invalid config:\n  - --set 'novalue'")


def test_a_json_file_must_hold_an_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3"}))
    assert read_json_object(path, "model.path") == {"model_type": "qwen3"}
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"^model.path: {path}: expected a JSON object$"):
        read_json_object(path, "model.path")
    path.write_text('{"model_type": ')
    with pytest.raises(ValueError, match=rf"^--adapter: {path}: unreadable \(Expecting value"):
        read_json_object(path, "--adapter")
    with pytest.raises(ValueError, match="unreadable"):
        read_json_object(tmp_path / "absent.json", "--adapter")
