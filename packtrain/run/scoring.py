"""Scoring generated predictions against targets, for ``packtrain eval --generate``; pure Python, no torch.

The metric is ``generate.metric``, chosen once at startup by :func:`load_scorer` (a bad spec, a missing module or
function is a :class:`ScorerError` before the model loads):

- ``exact``: 1 if the prediction equals the target, surrounding whitespace aside, else 0.
- ``json``: both sides parsed as JSON (a prediction may sit in one markdown code fence); the score is the fraction
  of the target's leaves (its values at flattened paths such as ``a.b[2].c``; an empty ``{}`` or ``[]`` is a leaf
  itself) that the prediction holds, equal, at the same path. Equality is JSON-typed: ``true`` is not ``1``, ``1``
  is ``1.0``. A prediction that does not parse scores 0 and counts as unparsed; a target that does not parse is a
  data error.
- ``python:module:function``: the user's ``function(prediction, target, example)``, imported with the config
  file's directory and the working directory searched first, returning a number in [0, 1].

Scorers see the texts after :func:`strip_thinking` when ``generate.strip_thinking`` is on; the caller strips them.
:func:`summarize` and :func:`errors_markdown` turn the scored rows into the eval's numbers and its error report.
:func:`check_text` refuses a metric that scores text where there is no tokenizer.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

METRICS = ("exact", "json", "python:<module>:<function>")

_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_FENCE = re.compile(r"```(?:json)?[ \t]*\n?(.*?)\n?[ \t]*```", re.DOTALL | re.IGNORECASE)
_MISSING = object()


class ScorerError(ValueError):
    """A ``generate.metric`` that cannot be loaded, a target that is not JSON, or a user scorer that failed."""


def strip_thinking(text: str) -> str:
    """``text`` without its thinking blocks, and without the whitespace right after each removed block.

    In this order: a ``</think>`` before any ``<think>`` (the chat template opened the block in the prompt) drops
    everything up to and including it; every complete ``<think>...</think>`` block goes (non-greedy, across lines);
    an unclosed ``<think>`` drops everything from it to the end. A later stray ``</think>`` stays.
    """
    close, open_ = text.find("</think>"), text.find("<think>")
    if close != -1 and (open_ == -1 or close < open_):
        text = text[close + len("</think>"):].lstrip()
    text = _BLOCK.sub("", text)
    unclosed = text.find("<think>")
    return text if unclosed == -1 else text[:unclosed]


@dataclass(frozen=True)
class Scorer:
    """A loaded ``generate.metric``; ``fn`` is the user's function of a ``python:`` spec (built by load_scorer)."""
    spec: str
    fn: Callable | None = field(default=None, compare=False, repr=False)

    def score(self, prediction: str, target: str, example) -> tuple[float, bool]:
        """(score in [0, 1], parsed); parsed is False only when the json metric cannot parse the prediction."""
        if self.spec == "exact":
            return (1.0 if prediction.strip() == target.strip() else 0.0), True
        if self.spec == "json":
            return _json_score(prediction, target, example)
        return self._user_score(prediction, target, example), True

    def _user_score(self, prediction: str, target: str, example) -> float:
        example_id = getattr(example, "id", None)
        try:
            value = self.fn(prediction, target, example)
        except KeyboardInterrupt:  # Ctrl-C stays the stop it is
            raise
        except BaseException as e:  # SystemExit included: it ended a run with exit 0, no adapter and no message
            raise ScorerError(f"generate.metric {self.spec}: the scorer raised {type(e).__name__}: {e} "
                              f"on example {example_id}") from e
        if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)) \
                and getattr(value, "ndim", None) == 0:  # a torch or numpy scalar, as a bool or a float is taken
            value = value.item()
        if isinstance(value, numbers.Real) and math.isfinite(value) and 0 <= value <= 1:
            return float(value)  # a bool is a Real: True -> 1.0
        raise ScorerError(f"generate.metric {self.spec}: the scorer returned {value!r} ({type(value).__name__}) "
                          f"on example {example_id}; it must return a finite number in [0, 1]")


def load_scorer(spec: str, search_dirs: Sequence[str | Path] = ()) -> Scorer:
    """The scorer of ``generate.metric``; a ``python:`` module is imported with ``search_dirs`` first on sys.path
    (sys.path is restored afterwards; the module stays in sys.modules)."""
    if spec in ("exact", "json"):
        return Scorer(spec)
    if not spec.startswith("python:"):
        raise ScorerError(f"generate.metric: {spec!r} is not a metric; choose one of {', '.join(METRICS)}")
    parts = spec[len("python:"):].split(":")
    if len(parts) != 2 or not all(parts):
        raise ScorerError(f"generate.metric: {spec!r} is malformed; a user scorer is python:<module>:<function>")
    module_name, fn_name = parts
    saved = list(sys.path)
    sys.path[:0] = [str(d) for d in search_dirs]
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # a module that calls sys.exit() at import is that scorer's error too
        if isinstance(e, ModuleNotFoundError) and e.name and (module_name + ".").startswith(e.name + "."):
            where = f"{', '.join(str(d) for d in search_dirs)}, then sys.path" if search_dirs else "sys.path"
            raise ScorerError(f"generate.metric: {spec!r}: module {module_name} not found (searched {where})") from e
        raise ScorerError(f"generate.metric: {spec!r}: importing {module_name} raised {type(e).__name__}: "
                          f"{e}") from e
    finally:
        sys.path[:] = saved
    if not hasattr(module, fn_name):
        raise ScorerError(f"generate.metric: {spec!r}: module {module_name} ({getattr(module, '__file__', '?')}) "
                          f"has no {fn_name}")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise ScorerError(f"generate.metric: {spec!r}: {module_name}.{fn_name} is not callable (it is a "
                          f"{type(fn).__name__})")
    return Scorer(spec, fn)


def _json_score(prediction: str, target: str, example) -> tuple[float, bool]:
    try:
        want = json.loads(target.strip())
    except ValueError as e:
        raise ScorerError(f"generate.metric json: example {getattr(example, 'id', None)}: the target is not JSON "
                          f"({e})") from e
    got = _parse_prediction(prediction)
    if got is _MISSING:
        return 0.0, False
    leaves = list(_leaves(want))
    equal = sum(_json_equal(value, _at(got, path)) for path, value in leaves)
    return equal / len(leaves), True


def _parse_prediction(prediction: str):
    """The prediction's JSON value, also from inside one code fence; _MISSING when it does not parse."""
    text = prediction.strip()
    fenced = _FENCE.fullmatch(text)
    for candidate in (text, fenced.group(1)) if fenced else (text,):
        try:
            return json.loads(candidate)
        except ValueError:
            pass
    return _MISSING


def _leaves(value, path: tuple = ()):
    """(path, value) of each leaf: a scalar or an empty container; a scalar or empty root is one leaf at ()."""
    if isinstance(value, dict) and value:
        for key, v in value.items():
            yield from _leaves(v, path + (key,))
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from _leaves(v, path + (i,))
    else:
        yield path, value


def _at(value, path: tuple):
    """The value at ``path`` (dict keys are str, list indices int), or _MISSING."""
    for step in path:
        if isinstance(step, str):
            found = isinstance(value, dict) and step in value
        else:
            found = isinstance(value, list) and step < len(value)
        if not found:
            return _MISSING
        value = value[step]
    return value


def _json_equal(a, b) -> bool:
    """Equality of JSON values by JSON type: Python's ``True == 1`` is not JSON's; ``1 == 1.0`` is."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_json_equal, a, b))
    return type(a) is type(b) and a == b


def summarize(rows: list[dict]) -> dict:
    """The eval's numbers from scored rows (``match``, ``score``, optional ``parsed``)."""
    n = len(rows)
    exact = sum(bool(r["match"]) for r in rows)
    return {"examples": n, "exact": exact,
            "exact_match": exact / n if n else None,
            "mean_score": sum(r["score"] for r in rows) / n if n else None,
            "unparsed": sum(not r.get("parsed", True) for r in rows)}


def first_difference(a, b) -> int | None:
    """The first index where two sequences differ (the shorter's length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def errors_markdown(rows: list[dict], prompts: dict[int, str], title: str) -> str:
    """The mismatches (rows whose ``match`` is False) as Markdown, grouped by prompt (``prompts[row["prompt"]]``:
    P's text or a label). A row's texts (``item``, ``target``, ``prediction``, ``scored``: the prediction as
    scored) may be missing, as with pretokenized data and no tokenizer: then its ``*_ids`` lists are shown."""
    s = summarize(rows)
    mean = "n/a" if s["mean_score"] is None else f"{s['mean_score']:.3f}"
    lines = [f"# {title}", "", f"exact {s['exact']}/{s['examples']}, mean score {mean}"]
    missed = [r for r in rows if not r["match"]]
    if not missed:
        return "\n".join(lines + ["", "No mismatches."]) + "\n"
    for p in sorted({r["prompt"] for r in missed}):
        mine = [r for r in missed if r["prompt"] == p]
        total = sum(r["prompt"] == p for r in rows)
        text = prompts.get(p, "")
        shown = " ".join(text[:300].split()) + (" …" if len(text) > 300 else "")
        lines += ["", f"## Prompt {p}: {len(mine)} of {total} examples mismatched", "", *_fenced(shown)]
        for r in mine:
            lines += ["", f"### {r.get('id')}: score {r['score']:.3f}", "", _where(r)]
            for name in ("item", "target", "prediction", "scored"):
                if name == "scored" and r.get("scored") == r.get("prediction"):
                    continue  # nothing was stripped
                shown = r.get(name)
                if shown is None and r.get(f"{name}_ids") is not None:
                    name, shown = f"{name}_ids", str(list(r[f"{name}_ids"]))
                if shown is not None:
                    lines += ["", f"{name}:", *_fenced(shown)]
    return "\n".join(lines) + "\n"


def _where(row: dict) -> str:
    """Where target and prediction part: the character in the stripped texts as scored, and the token."""
    found = []
    prediction = row.get("scored", row.get("prediction"))
    if row.get("target") is not None and prediction is not None:
        c = first_difference(row["target"].strip(), prediction.strip())
        found.append("texts equal after stripping" if c is None else f"first difference at character {c}")
    if row.get("target_ids") is not None and row.get("prediction_ids") is not None:
        t = first_difference(list(row["target_ids"]), list(row["prediction_ids"]))
        found.append("ids equal" if t is None else f"token {t}")
    return ", ".join(found) or "no text or ids to compare"


def _fenced(text: str) -> list[str]:
    """``text`` in a code fence longer than any backtick run inside it, so Markdown shows it as it is."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, text, fence]


def check_text(scorer: Scorer, tokenizer) -> None:
    """Only the exact metric works on ids alone (pretokenized data without a tokenizer); checked at start."""
    if tokenizer is None and scorer.spec != "exact":
        raise ScorerError(f"generate.metric: {scorer.spec!r} scores text, and there is no tokenizer for this "
                          "pretokenized data (set data.tokenizer, or use the exact metric, which compares ids)")
