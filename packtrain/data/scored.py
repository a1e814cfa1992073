"""Scored groups: one request with K sampled completions and their rewards (``train.objective: grpo``; online runs
write their samples in the pretokenized form, :mod:`packtrain.run.rollouts`).

Per format (:data:`GROUP_KEYS`):

- text: ``{"id"?, "system", "item", "completions": [str, ...], "rewards": [number, ...], "logprobs"?, "images"?}``;
- chat: ``{"id"?, "messages", "tools"?, "completions": [assistant message or str, ...], "rewards", "logprobs"?}``;
- pretokenized: ``{"id"?, "prefix_ids", "item_ids", "completion_ids": [[int, ...], ...], "rewards", "logprobs"?}``.

``logprobs`` (optional) are the sampling engine's log-probabilities of each completion's tokens, one list per
completion and one number per token: the importance ratio's old policy. A group becomes K examples
(:class:`~packtrain.data.example.Example`), ids ``ID:0`` .. ``ID:K-1``, with ``group`` = ID, their ``reward`` and
``logprobs``; they share P and the item, so they are the tree P -> item -> K answers. A group with fewer than two
completions, rewards that are not one finite number per completion, or logprobs whose counts differ from the
completions' tokens is refused naming the file, the line and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from packtrain.data.example import DataError, LineErrors

GROUP_KEYS = {"text": ("id", "system", "item", "completions", "rewards", "logprobs", "images"),
              "chat": ("id", "messages", "tools", "completions", "rewards", "logprobs"),
              "pretokenized": ("id", "prefix_ids", "item_ids", "completion_ids", "rewards", "logprobs")}
COMPLETIONS = {"text": "completions", "chat": "completions", "pretokenized": "completion_ids"}
_SINGLE = {"text": ("target", "chosen", "rejected"), "chat": ("target", "chosen", "rejected"),
           "pretokenized": ("target_ids", "chosen_ids", "rejected_ids")}


def group_examples(examples: Sequence) -> list[tuple[int, ...]]:
    """The indices of every scored group's completions among ``examples``, completion 0 first, in the order of their
    groups' first completions."""
    where: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        if getattr(ex, "group", ""):
            where.setdefault(ex.group, []).append(i)
    return [tuple(members) for members in where.values()]


def is_group(record: dict) -> bool:
    """A scored group: it names completions or rewards (a missing one is refused, naming it)."""
    return any(key in record for key in ("completions", "completion_ids", "rewards"))


def group_completions(record: dict, fmt: str, source: Path, line: int) -> list:
    """The record's completions (K >= 2), no single target or preference answers beside them."""
    name = COMPLETIONS[fmt]
    for other in _SINGLE[fmt]:
        if other in record:
            raise DataError(source, line, other, f"a scored group has {name} and rewards, not {other} too")
    if name not in record:
        raise DataError(source, line, name, "missing: a scored group needs its completions and their rewards")
    completions = record[name]
    if not isinstance(completions, list):
        raise DataError(source, line, name, f"expected a list of completions, got {json.dumps(completions)[:60]}")
    if len(completions) < 2:
        raise DataError(source, line, name, f"a group needs 2 or more completions to compare (it has "
                                            f"{len(completions)})")
    return completions


def group_rewards(record: dict, k: int, source: Path, line: int) -> tuple[float, ...]:
    """One finite reward per completion."""
    if "rewards" not in record:
        raise DataError(source, line, "rewards", "missing: a scored group needs one reward per completion")
    rewards = record["rewards"]
    if not isinstance(rewards, list) or len(rewards) != k:
        got = f"{len(rewards)} rewards" if isinstance(rewards, list) else json.dumps(rewards)[:60]
        raise DataError(source, line, "rewards", f"expected one number per completion ({k}), got {got}")
    for i, value in enumerate(rewards):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(source, line, f"rewards[{i}]", f"expected a finite number, got {json.dumps(value)[:60]}")
    return tuple(float(r) for r in rewards)


def group_logprobs(record: dict, k: int, source: Path, line: int) -> list[tuple[float, ...]] | None:
    """The sampler's log-probabilities, one list per completion (None when the record has none): finite, at most 0.
    Their counts are checked against the tokens by :func:`check_logprobs` once the completions are tokenized."""
    if "logprobs" not in record:
        return None
    value = record["logprobs"]
    if not isinstance(value, list) or len(value) != k:
        got = f"{len(value)} lists" if isinstance(value, list) else json.dumps(value)[:60]
        raise DataError(source, line, "logprobs", f"expected one list per completion ({k}), got {got}")
    out = []
    for i, per in enumerate(value):
        if not isinstance(per, list):
            raise DataError(source, line, f"logprobs[{i}]", f"expected a list of numbers, got {json.dumps(per)[:60]}")
        for t, x in enumerate(per):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x > 0:
                raise DataError(source, line, f"logprobs[{i}][{t}]",
                                f"expected a log-probability (a finite number, at most 0), got {json.dumps(x)[:60]}")
        out.append(tuple(float(x) for x in per))
    return out


def check_groups(examples: Sequence, source: Path, fmt: str, errors: LineErrors) -> None:
    """Each group's completions share P and the item (a chat template could read a completion into either), and
    each one's log-probabilities count its target tokens once tokenized; a group that does not is its line's error
    in ``errors``."""
    first: dict[str, object] = {}
    for ex in examples:
        if not getattr(ex, "group", ""):
            continue
        k = ex.id.rsplit(":", 1)[1]
        lead = first.setdefault(ex.group, ex)
        if ex.prefix_ids != lead.prefix_ids or ex.item_ids != lead.item_ids:
            errors.add(DataError(source, ex.line, f"{COMPLETIONS[fmt]}[{k}]", "renders another prompt than "
                                 f"{COMPLETIONS[fmt]}[0] (the chat template reads the completion into P or the "
                                 "item): a group's completions share P and the item"))
        elif ex.logprobs is not None and len(ex.logprobs) != len(ex.target_ids):
            errors.add(DataError(source, ex.line, f"logprobs[{k}]", f"{len(ex.logprobs)} log-probabilities for "
                                 f"completion {k}'s {len(ex.target_ids)} tokens (as the chat template renders and the "
                                 "tokenizer splits it, its end-of-turn tokens included): one per token"))


def check_logprobs(logprobs: tuple[float, ...], tokens: int, i: int, source: Path, line: int) -> None:
    """Completion ``i``'s log-probabilities: one per token of its (tokenized) completion."""
    if len(logprobs) != tokens:
        raise DataError(source, line, f"logprobs[{i}]", f"{len(logprobs)} log-probabilities for completion {i}'s "
                                                        f"{tokens} tokens: one per token")
