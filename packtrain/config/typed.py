"""A typed tree of dataclasses built from YAML: every problem (an unknown key, a wrong type) collected with its dotted
path into one :class:`ConfigError`; YAML read as 1.2 reads floats, with a key given twice in one mapping refused;
``--set section.key=value`` overrides parsed as YAML. Nothing here knows packtrain's schema
(:mod:`packtrain.config`)."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class _Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where ``1e-4`` is a string; accept it as a float, as YAML 1.2 does. A key given twice
    in one mapping is an error (PyYAML keeps the last one silently, dropping the first block whole)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
            if first != key_node.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first}): each key may appear once in a "
                    "mapping (merge the two blocks)", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def read_json_object(path: Path, label: str) -> dict:
    """A JSON file that must hold an object (a model's config.json, an adapter's adapter_config.json); anything
    else is a :class:`ValueError` naming ``label`` and the file (one line at the CLI)."""
    import json

    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{label}: {path}: unreadable ({e}); a damaged or truncated copy?") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{label}: {path}: expected a JSON object")  # noqa: TRY004 - a user error: exit 2
    return raw


class ConfigError(ValueError):
    """A config that cannot be used; ``problems`` lists every dotted path that is wrong."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        where = f" in {source}" if source else ""
        super().__init__(f"invalid config{where}:\n" + "\n".join(f"  - {p}" for p in problems))


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def check_value(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return (ok, coerced value). Ints are accepted where floats are expected; bools are never ints."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return (value in typing.get_args(tp)), value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, v = check_value(value, arg)
            if ok:
                return True, v
        return False, value
    if origin is list:
        if not isinstance(value, list):
            return False, value
        (item_tp,) = typing.get_args(tp)
        out = []
        for item in value:
            ok, v = check_value(item, item_tp)
            if not ok:
                return False, value
            out.append(v)
        return True, out
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if tp is dict:
        return isinstance(value, dict), value
    raise TypeError(f"unsupported config type {tp!r}")


def build(cls: type, raw: Any, prefix: str, problems: list[str]):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{prefix or 'config'}: expected a mapping, got {type(raw).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            problems.append(f"{path}: unknown key (known: {', '.join(sorted(fields))})")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build(tp, value, path, problems)
            continue
        ok, coerced = check_value(value, tp)
        if not ok:
            problems.append(f"{path}: expected {type_name(tp)}, got {value!r}")
            continue
        kwargs[key] = coerced
    return cls(**kwargs)


def get_dotted(obj, dotted: str):
    """The value at ``dotted`` (``section.key``) of a config tree."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], value parsed as YAML)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or "" in key.strip().split("."):
        raise ConfigError([f"--set {text!r}: expected section.key=value"])
    try:
        parsed = load_yaml(value) if value.strip() else None
    except yaml.YAMLError:
        raise ConfigError([f"--set {text!r}: the value is not valid YAML"]) from None
    return key.strip().split("."), parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    parsed, problems = [], []
    for text in overrides:
        try:
            parsed.append(parse_override(text))
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems)
    for keys, value in parsed:
        node = raw
        for k in keys[:-1]:
            nxt = node.get(k)
            if not isinstance(nxt, dict):
                nxt = {}
                node[k] = nxt
            node = nxt
        node[keys[-1]] = value
    return raw


def yaml_problem(e: yaml.YAMLError) -> str:
    """``line L, column C: problem`` (PyYAML's own text names "<unicode string>" and spans several lines)."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or problem is None:
        return str(e)
    context = getattr(e, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")
