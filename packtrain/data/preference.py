"""Preference pairs and example weights in the three input formats (``train.objective: dpo | weighted``).

A preference record is one request with two answers. Per format (:data:`PAIR_KEYS`):

- text: ``{"id"?, "system", "item", "chosen", "rejected", "images"?, "weight"?}``: the answers are strings, in the
  place of ``target``;
- chat: ``{"id"?, "messages", "chosen", "rejected", "tools"?, "weight"?}``: ``messages`` are the prompt turns (a
  system message first, then user / assistant / tool messages ending with a user or tool message), each answer an
  assistant message, a list of one assistant message (TRL's conversational form), or its content as a string;
- pretokenized: ``{"id"?, "prefix_ids", "item_ids", "chosen_ids", "rejected_ids", "weight"?}``.

TRL's preference records are read where they map exactly onto these (:func:`trl_pair`): its conversational form
(``prompt`` a list of messages opening with the system message, ``chosen`` and ``rejected`` lists of one assistant
message) is a chat pair with ``prompt`` as ``messages``; its implicit-prompt conversational form (``chosen`` and
``rejected`` whole conversations, the same up to their last, assistant, message) is the chat pair of that shared
start and the two last messages. What does not map is refused with the mapping: a conversational prompt without a
system message (packtrain's P), and TRL's plain-text forms (``prompt`` a string, or ``chosen`` and ``rejected``
whole texts), which TRL trains as raw text and packtrain renders through the chat template.

A pair becomes two examples (:class:`~packtrain.data.example.Example`), ids ``ID:chosen`` and ``ID:rejected``, with
``pair`` = ID and ``side``; they share P and the item, so they are the tree P -> item -> {chosen, rejected}. Any
record may carry a finite ``weight`` (negative allowed: an advantage), which every example made of it carries.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from packtrain.data.example import DataError, LineErrors

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


_TEXT_PAIR = ("packtrain's text pair is {system, item, chosen, rejected}, rendered through the chat template as a "
              "system turn (P, shared by the examples that have it), a user turn and the assistant's answer")
_SYSTEM_FIRST = ("packtrain's chat pair opens with the system message (P, shared by the examples that have it): put "
                 '{"role": "system", "content": ...} first')


def trl_pair(record: dict, source: Path, line: int) -> tuple[dict, Callable[[str | None], str | None]] | None:
    """A record in one of TRL's preference forms as packtrain's chat pair, with what turns a field of the pair back
    into the record's own (for errors); None for a record in none of them. A TRL form that does not map exactly is
    refused, the message giving the mapping."""
    if "messages" in record or not any(key in record for key in SIDES):
        return None
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        raise DataError(source, line, "prompt", "a plain-text prompt (TRL's standard form, trained as raw text "
                                                f"without a chat template): {_TEXT_PAIR}: rename prompt to item "
                                                "and give the system prompt as system")
    if "prompt" in record:
        if not isinstance(prompt, list) or not prompt:
            raise DataError(source, line, "prompt", "expected TRL's conversational prompt: a list of messages (it "
                                                    "is packtrain's messages)")
        if not isinstance(prompt[0], dict) or prompt[0].get("role") != "system":
            raise DataError(source, line, "prompt[0]", "TRL's conversational prompt maps to packtrain's messages, "
                                                       f"but has no system message first: {_SYSTEM_FIRST}")
        converted = {("messages" if key == "prompt" else key): value for key, value in record.items()}
        return converted, lambda field: _renamed(field, "messages", "prompt")
    chosen, rejected = record.get("chosen"), record.get("rejected")
    if isinstance(chosen, list) and isinstance(rejected, list) and (len(chosen) > 1 or len(rejected) > 1):
        return _implicit_prompt(record, chosen, rejected, source, line)
    if isinstance(chosen, str) and not any(key in record for key in ("system", "item", "prefix_ids", "item_ids")):
        raise DataError(source, line, "chosen", "a whole text, prompt and answer in one, without a system or item "
                                                f"(TRL's implicit-prompt form): {_TEXT_PAIR}: give the system prompt "
                                                "as system, the request as item, and only the two answers as chosen "
                                                "and rejected")
    return None


def _implicit_prompt(record: dict, chosen: list, rejected: list, source: Path, line: int):
    """TRL's implicit-prompt conversational form: two whole conversations the same up to their last message."""
    last = min(len(chosen), len(rejected)) - 1
    differ = next((i for i in range(last) if chosen[i] != rejected[i]), None)
    if differ is not None or len(chosen) != len(rejected):
        at = last if differ is None else differ
        raise DataError(source, line, f"rejected[{at}]", "TRL's implicit-prompt form (chosen and rejected whole "
                                                         "conversations) maps to packtrain's chat pair only where the "
                                                         "two are the same up to their last message, each answer "
                                                         f"one assistant message; they differ at message {at}: give "
                                                         "the shared turns as messages and the two answers as chosen "
                                                         "and rejected")
    if not isinstance(chosen[0], dict) or chosen[0].get("role") != "system":
        raise DataError(source, line, "chosen[0]", "TRL's implicit-prompt form maps to packtrain's chat pair (the "
                                                   "shared turns as messages, the last messages as chosen and "
                                                   f"rejected), but has no system message first: {_SYSTEM_FIRST}")
    converted = {**{key: value for key, value in record.items() if key not in SIDES},
                 "messages": chosen[:-1], "chosen": chosen[-1], "rejected": rejected[-1]}

    def rename(field: str | None) -> str | None:
        side = next((side for side in SIDES if _under(field, side)), None)
        return _renamed(field, side, f"{side}[{last}]") if side else _renamed(field, "messages", "chosen")

    return converted, rename


def _under(field: str | None, name: str) -> bool:
    """``field`` is ``name`` or a part of it (``messages[2].content`` is under ``messages``)."""
    return field is not None and (field == name or field.startswith((f"{name}[", f"{name}.")))


def _renamed(field: str | None, old: str, new: str) -> str | None:
    """``field`` with its first name ``old`` written ``new`` (``messages[2].content`` -> ``prompt[2].content``)."""
    return new + field[len(old):] if _under(field, old) else field


def check_pairs(examples: Sequence, source: Path, fields: dict[str, str], errors: LineErrors) -> None:
    """Each pair's two examples share P and the item and differ in their answers' tokens (``fields``: the answer
    field of each side, for the error); a pair that does not is its line's error in ``errors``."""
    by_pair: dict[str, dict[str, Any]] = {}
    for ex in examples:
        if ex.pair:
            by_pair.setdefault(ex.pair, {})[ex.side] = ex
    for sides in by_pair.values():
        chosen, rejected = sides["chosen"], sides["rejected"]
        if chosen.target_ids == rejected.target_ids:
            errors.add(DataError(source, rejected.line, fields["rejected"], "the same answer as chosen: a preference "
                                                                            "pair needs two different answers"))
        elif chosen.prefix_ids != rejected.prefix_ids or chosen.item_ids != rejected.item_ids:
            errors.add(DataError(source, rejected.line, fields["rejected"], "renders another prompt than chosen (the "
                                                                            "chat template reads the answer into P "
                                                                            "or the item): a pair's answers share P "
                                                                            "and the item"))


def pair_examples(examples: Sequence) -> list[tuple[int, int]]:
    """(chosen index, rejected index) of every pair among ``examples``, in the order of their chosen examples."""
    where: dict[str, dict[str, int]] = {}
    for i, ex in enumerate(examples):
        if getattr(ex, "pair", ""):
            where.setdefault(ex.pair, {})[ex.side] = i
    return [(sides["chosen"], sides["rejected"]) for sides in where.values() if len(sides) == 2]
