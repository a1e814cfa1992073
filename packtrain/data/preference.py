"""Preference pairs and example weights in the three input formats (``train.objective: dpo | weighted``).

A preference record is one request with two answers. Per format (:data:`PAIR_KEYS`):

- text: ``{"id"?, "system", "item", "chosen", "rejected", "images"?, "weight"?}``: the answers are strings, in the
  place of ``target``;
- chat: ``{"id"?, "messages", "chosen", "rejected", "tools"?, "weight"?}``: ``messages`` are the prompt turns (a
  system message first, then user / assistant / tool messages ending with a user or tool message), each answer an
  assistant message, a list of one assistant message (TRL's conversational form), or its content as a string;
- pretokenized: ``{"id"?, "prefix_ids", "item_ids", "chosen_ids", "rejected_ids", "weight"?}``.

A pair becomes two examples (:class:`~packtrain.data.example.Example`), ids ``ID:chosen`` and ``ID:rejected``, with
``pair`` = ID and ``side``; they share P and the item, so they are the tree P -> item -> {chosen, rejected}. Any
record may carry a finite ``weight`` (negative allowed: an advantage), which every example made of it carries.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from packtrain.data.example import DataError

SIDES = ("chosen", "rejected")
PAIR_KEYS = {"text": ("id", "system", "item", "chosen", "rejected", "images", "weight"),
             "chat": ("id", "messages", "tools", "chosen", "rejected", "weight"),
             "pretokenized": ("id", "prefix_ids", "item_ids", "chosen_ids", "rejected_ids", "weight")}
SIDE_FIELDS = {"text": SIDES, "chat": SIDES, "pretokenized": ("chosen_ids", "rejected_ids")}


def is_pair(record: dict) -> bool:
    """A preference record: it names an answer of a pair (either side: a missing one is refused, naming it)."""
    return any(key in record for names in SIDE_FIELDS.values() for key in names)


def pair_fields(record: dict, fmt: str, source: Path, line: int) -> tuple[str, str]:
    """The record's two answer fields, both given and no ``target`` beside them (else the error names the field)."""
    chosen, rejected = SIDE_FIELDS[fmt]
    single = "target_ids" if fmt == "pretokenized" else "target"
    if single in record:
        raise DataError(source, line, single, f"a preference pair has {chosen} and {rejected}, not {single} too")
    for name in (chosen, rejected):
        if name not in record:
            raise DataError(source, line, name, f"missing: a preference pair needs both {chosen} and {rejected}")
    return chosen, rejected


def weight_of(record: dict, source: Path, line: int) -> float:
    """The record's ``weight``: a finite number (1 when absent). NaN, infinity and a float past the double range
    are refused by the strict JSON parser already (packtrain.data.jsonl), naming the field."""
    if "weight" not in record:
        return 1.0
    value = record["weight"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(source, line, "weight", f"expected a finite number, got {json.dumps(value)[:60]}")
    return float(value)


def chat_answer(value: Any, field: str, source: Path, line: int) -> dict:
    """An answer of a chat pair as an assistant message: a message, a list of one (TRL's form), or its content."""
    if isinstance(value, list):
        if len(value) != 1:
            raise DataError(source, line, field, f"expected one assistant message, got a list of {len(value)}")
        value, field = value[0], f"{field}[0]"
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if not isinstance(value, dict):
        raise DataError(source, line, field, "expected an assistant message (an object with role assistant), a list "
                                             f"of one, or its content as a string; got {json.dumps(value)[:60]}")
    if value.get("role", "assistant") != "assistant":
        raise DataError(source, line, f"{field}.role", f"an answer is an assistant message, got "
                                                       f"{json.dumps(value.get('role'))}")
    return {"role": "assistant", **value}


def check_pairs(examples: Sequence, source: Path, fields: dict[str, str]) -> None:
    """Each pair's two examples share P and the item and differ in their answers' tokens (``fields``: the answer
    field of each side, for the error)."""
    by_pair: dict[str, dict[str, Any]] = {}
    for ex in examples:
        if ex.pair:
            by_pair.setdefault(ex.pair, {})[ex.side] = ex
    for sides in by_pair.values():
        chosen, rejected = sides["chosen"], sides["rejected"]
        if chosen.target_ids == rejected.target_ids:
            raise DataError(source, rejected.line, fields["rejected"], "the same answer as chosen: a preference pair "
                                                                       "needs two different answers")
        if chosen.prefix_ids != rejected.prefix_ids or chosen.item_ids != rejected.item_ids:
            raise DataError(source, rejected.line, fields["rejected"], "renders another prompt than chosen (the "
                                                                       "chat template reads the answer into P or "
                                                                       "the item): a pair's answers share P and "
                                                                       "the item")


def pair_examples(examples: Sequence) -> list[tuple[int, int]]:
    """(chosen index, rejected index) of every pair among ``examples``, in the order of their chosen examples."""
    where: dict[str, dict[str, int]] = {}
    for i, ex in enumerate(examples):
        if getattr(ex, "pair", ""):
            where.setdefault(ex.pair, {})[ex.side] = i
    return [(sides["chosen"], sides["rejected"]) for sides in where.values() if len(sides) == 2]
