"""Examples from JSONL, one per line, each split into a shared prefix P, an item and a target.

Three formats (``data.format``; detected from the first line when omitted):

- text: ``{"id"?, "system": str, "item": str, "target": str, "images"?: [path]}``
- chat: ``{"id"?, "messages": [...], "tools"?: [JSON function schema]}``: one system message first, then user,
  assistant and tool messages. An assistant message has ``content`` and may carry ``reasoning_content`` (str) and
  ``tool_calls`` (``[{"type": "function", "function": {"name": str, "arguments": object | str}}]``); a ``tool``
  message carries a tool's result and follows an assistant message with tool calls (or another tool message). A
  system, user or assistant message may carry ``name`` (OpenAI's speaker name): it goes to the template, which must
  write it (:mod:`packtrain.data.chat`).
- pretokenized: ``{"id"?, "prefix_ids": [int], "item_ids": [int], "target_ids": [int]}``

Every format also takes preference pairs (``chosen`` and ``rejected`` in place of the target; TRL's forms where
they map onto a chat pair) and a ``weight`` on any record: :mod:`packtrain.data.preference`.

A bad line is refused naming its file, line and field; every bad line of a file at once (its first problem each, the
first 20 listed: :class:`~packtrain.data.example.BadLines`), in line order, so every rank raises the same error.

Text and chat go through the tokenizer's chat template (or ``data.chat_template``), with ``data.template_kwargs``
(e.g. ``enable_thinking``) in every render and the example's tools in P. P is the system block: what the template
writes before the first user turn, tools included, found without rendering the system message alone (Qwen's
official templates refuse a conversation without a user query; :mod:`packtrain.data.chat`). A template whose P is
empty, lacks the system text, or is one P for different system texts or tools is refused. Tool-call arguments
given as JSON text are parsed first (Qwen's templates iterate ``arguments|items``). Special tokens written in a
message's text are read as tokens, as at inference. Which assistant turns carry loss is ``data.train_on``:

- ``last``: the final assistant message. The item is everything after P up to and including the generation prompt
  (``<|im_start|>assistant\n`` and whatever the template adds, e.g. ``<think>\n``); the target is the rest, so it
  includes the closing ``<|im_end|>`` and newline: the model learns to stop. Earlier turns are item.
- ``all``: one example per conversation with loss on every assistant turn as rendered in the whole conversation,
  each turn as under ``last``, in one sequence. A template that renders an earlier turn differently once later
  turns follow (Qwen's drops reasoning before the last user message), or a turn whose tokens the next prompt,
  tokenized whole, merges otherwise, is refused for that example, naming the turn: use ``each``.
- ``each``: one example per assistant turn (ids ``ID#1``, ``ID#2``, ... when there are several), its history
  rendered as the template renders it when generating that turn: ``last`` on the conversation cut after the turn.
  All of them share P.

A text example is the chat [system, user=item, assistant=target]. The per-example loss is the mean over its target
tokens (all of its assistant turns' under ``all``).

Tokenized as the model reads and generates it: a trained turn's prompt (through the generation prompt) is tokenized
alone, as at inference, and the turn's own text as its own piece, as generated; the example is their
concatenation. Where that differs from tokenizing the whole render (Qwen's ``\n\n`` token across ``<think>\n`` +
``\n</think>``) the example says so (:attr:`Example.whole_differs`; ``plan`` counts them). P's tokens must be a
prefix of every prompt's, or the example is refused, naming its file, line and field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from packtrain.config import Config

from packtrain.data.chat import tokenize
from packtrain.data.example import Conversation, DataError, Example, LineErrors
from packtrain.data.preference import (
    PAIR_KEYS,
    SIDE_FIELDS,
    SIDES,
    chat_answer,
    check_pairs,
    is_pair,
    pair_fields,
    trl_pair,
    weight_of,
)
from packtrain.data.scored import (
    GROUP_KEYS,
    check_groups,
    check_logprobs,
    group_completions,
    group_logprobs,
    group_rewards,
    is_group,
)

FORMATS = ("text", "chat", "pretokenized")
BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
# a tokenizer folder's files (transformers reads these, and additional_chat_templates/*.jinja beside them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
ROLES = ("system", "user", "assistant", "tool")
# The keys an example and a message may have; any other is refused, naming it: a key packtrain does not read was
# dropped silently (``enable_thinking`` on an example, ``thinking`` on a message: neither reached the template)
EXAMPLE_KEYS = {"text": ("id", "system", "item", "target", "images", "weight"),
                "chat": ("id", "messages", "tools", "weight"),
                "pretokenized": ("id", "prefix_ids", "item_ids", "target_ids", "weight")}
MESSAGE_KEYS = {"system": ("role", "content", "name"), "user": ("role", "content", "name"),
                "assistant": ("role", "content", "name", "reasoning_content", "tool_calls"),
                "tool": ("role", "content", "name", "tool_call_id")}
_UNKNOWN_HINTS = {"enable_thinking": "template switches go in data.template_kwargs, for every example",
                  "preserve_thinking": "template switches go in data.template_kwargs, for every example",
                  "thinking": "a turn's reasoning goes in reasoning_content", "reasoning": "a turn's reasoning goes "
                  "in reasoning_content",
                  **dict.fromkeys(("prompt", "completion"), "TRL's prompt-completion form maps as: chat, messages = the "
                                  "prompt's messages then the completion's assistant message; text, system = the "
                                  "system prompt (P), item = prompt, target = completion")}
# A JSON line holding an example that fits a pack of B tokens has fewer than this many bytes per token of B: text
# averages about 4 bytes per token, JSON-escaped CJK (\\uXXXX) about 9, pre-tokenized ids ("12345, ") up to 8.
LINE_BYTES_PER_TOKEN = 32


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A local tokenizer directory (nothing is downloaded); None: the small tokenizer bundled for demos and tests.

    The generic fast class reads any directory with a tokenizer.json (a Qwen checkpoint has one) and imports in
    about a second, where AutoTokenizer's import takes over three.
    """
    from transformers import PreTrainedTokenizerFast

    path = Path(path) if path is not None else BUNDLED_TOKENIZER
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer.json in the tokenizer directory {path}")
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    except UnicodeDecodeError:
        raise ValueError(_not_utf8(path)) from None
    except Exception as e:  # noqa: BLE001 - the tokenizers library's own errors too: any means unreadable
        raise ValueError(f"tokenizer {path}: cannot be loaded ({type(e).__name__}: {str(e)[:200]}); a damaged "
                         "tokenizer.json or tokenizer_config.json?") from None


def _not_utf8(folder: Path) -> str:
    """Which text file of a tokenizer directory is not UTF-8, and where."""
    for file in sorted(folder.iterdir()):
        if file.is_file() and file.suffix in (".jinja", ".json", ".txt"):
            try:
                file.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                what = " (the tokenizer's chat template; data.chat_template replaces it)" if file.suffix == ".jinja" \
                    else ""
                return (f"tokenizer {folder}: {file.name} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                        f"{e.start}){what}: save it as UTF-8")
    return f"tokenizer {folder}: a file is not UTF-8 text"


def _records(path: Path, max_line_bytes: int | None = None) -> Iterator[tuple[int, dict | DataError]]:
    """(line number, JSON object, or the DataError saying why the line is not one) for each non-blank line; a line
    over ``max_line_bytes`` is refused before it is read whole, parsed or tokenized: its error costs neither the time
    nor the memory of reading it (docs/performance.md, "Refusing an oversized line"); the rest of it is skipped in
    pieces of that size."""
    if not path.is_file():
        raise DataError(path, None, None, "is a directory, not a JSONL file" if path.is_dir() else "file not found")
    limit = -1 if max_line_bytes is None else max_line_bytes + 1
    try:
        f = path.open("rb")
    except OSError as e:  # no permission: the data's error, never blamed on output_dir
        raise DataError(path, None, None, f"cannot be read: {e.strerror}") from None
    with f:
        for line_no, line in enumerate(iter(lambda: f.readline(limit), b""), 1):
            if max_line_bytes is not None and len(line.rstrip(b"\r\n")) > max_line_bytes:
                while not line.endswith(b"\n") and line:
                    line = f.readline(limit)
                yield line_no, DataError(path, line_no, None, f"line longer than {max_line_bytes:,} bytes: "
                                         f"{LINE_BYTES_PER_TOKEN} bytes per token of packing.token_budget, more than "
                                         "any example that fits a pack (a missing newline joins lines)")
                continue
            if not line.strip():
                continue
            try:
                record = _strict_json(line.rstrip(b"\r\n"), path, line_no, "")  # a cut line: "Unterminated string"
            except UnicodeDecodeError:
                record = DataError(path, line_no, None, "not valid UTF-8")
            except json.JSONDecodeError as e:
                record = DataError(path, line_no, None, f"not valid JSON: {e.msg} (column {e.colno})")
            except DataError as e:
                record = e
            if not isinstance(record, (dict, DataError)):
                record = DataError(path, line_no, None, f"expected a JSON object, got {type(record).__name__}")
            yield line_no, record


def _strict_json(text: str | bytes, source: Path, line: int, where: str):
    """JSON as the standard has it: a key given twice in one object, ``NaN`` / ``Infinity`` (and a number too large
    for a float, ``1e999``), and a lone UTF-16 surrogate are refused naming the field (``where``: the field whose text
    this is, "" for a whole line); Python's json takes each silently. Other syntax errors are json's own."""
    value = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_NotANumber, parse_float=_finite_float)
    found = _not_text(value, where)
    if found is not None:
        field, bad = found
        if isinstance(bad, _Duplicated):
            raise DataError(source, line, field, "given twice in one object (JSON keeps the last silently)")
        if isinstance(bad, _NotANumber):
            raise DataError(source, line, field, f"{bad.text} is not a JSON number (JSON has no NaN or infinity): "
                            "give a finite number, or a string")
        raise DataError(source, line, field, "holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
                        "pair): not text any tokenizer can encode")
    return value


class _Duplicated(dict):
    """An object that gave ``key`` twice (json keeps the last): found and refused, naming its field."""

    def __init__(self, items, key: str):
        super().__init__(items)
        self.key = key


def _unique_keys(items: list[tuple[str, object]]) -> dict:
    """json's object hook (an object's (key, value) items in order): a dict, or a :class:`_Duplicated` naming a key
    given twice."""
    out = dict(items)
    if len(out) != len(items):
        seen = set()
        for key, _ in items:
            if key in seen:
                return _Duplicated(out, key)
            seen.add(key)
    return out


class _NotANumber:
    """What the strict parser makes of ``NaN``, ``Infinity`` and a float that overflows: found and refused."""

    def __init__(self, text: str):
        self.text = text


def _finite_float(text: str):
    value = float(text)
    return value if math.isfinite(value) else _NotANumber(text)


def _not_text(value, where: str = "") -> tuple[str, object] | None:
    """(field, value) of the first value no example may hold: a :class:`_NotANumber`, an object with a key given
    twice (:class:`_Duplicated`), or a string that is not encodable text (JSON's ``\\ud800`` escapes parse to a lone
    surrogate that tokenizers reject with a TypeError). The field is ``messages[2].content``; None when every value
    is fine."""
    if isinstance(value, _NotANumber):
        return where, value
    if isinstance(value, _Duplicated):
        return f"{where}.{value.key}" if where else value.key, value
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "(the key)", value
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _not_text(key, where) or _not_text(item, f"{where}.{key}" if where else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _not_text(item, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def _empty_file(path: Path) -> DataError:
    return DataError(path, None, None, "empty file: no examples")


def _format_of(record: dict, source: Path, line: int) -> str:
    # TRL's conversational pairs: a prompt of messages, or whole conversations as the answers
    if "messages" in record or isinstance(record.get("prompt"), list):
        return "chat"
    if "prefix_ids" in record or "chosen_ids" in record:
        return "pretokenized"
    if "system" in record or "target" in record or "chosen" in record:
        return "chat" if isinstance(record.get("chosen"), list) and "system" not in record else "text"
    completion = ("; TRL's prompt-completion form is packtrain's text format: system (the system prompt, P), item "
                  "= prompt, target = completion") if "completion" in record else ""
    raise DataError(source, line, None, f"cannot tell the format from the keys {sorted(record)}: expected "
                                        "system/item/target (text), messages (chat) or prefix_ids/item_ids/"
                                        "target_ids (pretokenized); a preference pair has chosen and rejected "
                                        f"(chosen_ids and rejected_ids) in place of the target{completion}")


def _first_format(records: Iterator[tuple[int, dict | DataError]], path: Path) -> str:
    """The format of the first record that tells it; when none does, every line's error (or: the file is empty)."""
    errors = LineErrors()
    for line, record in records:
        if isinstance(record, DataError):
            errors.add(record)
            continue
        with errors.catch():
            return _format_of(record, path, line)
    errors.raise_any()
    raise _empty_file(path)


def detect_format(path: str | Path, max_line_bytes: int | None = None) -> str:
    """The format of a JSONL file, from the keys of its first example (bad lines before it are skipped: loading the
    file names them)."""
    path = Path(path)
    return _first_format(_records(path, max_line_bytes), path)


def _known_keys(obj: dict, known: tuple[str, ...], what: str, where: str, source: Path, line: int) -> None:
    """A key of ``obj`` (an example, or the message at ``where``) outside ``known`` is refused, naming it."""
    unknown = [key for key in obj if key not in known]
    if unknown:
        key = unknown[0]
        hint = f"; {_UNKNOWN_HINTS[key]}" if key in _UNKNOWN_HINTS else ""
        raise DataError(source, line, f"{where}.{key}" if where else key,
                        f"unknown key: {what} has {', '.join(known)}{hint}")


def _field(record: dict, name: str, fmt: str, source: Path, line: int) -> Any:
    if name not in record:
        raise DataError(source, line, name, f"missing (the {fmt} format needs it)")
    return record[name]


def _string(value: Any, field: str, source: Path, line: int, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise DataError(source, line, field, f"expected a string, got {json.dumps(value)[:60]}")
    if nonempty and not value.strip():
        raise DataError(source, line, field, "empty")
    return value


def _token_ids(value: Any, field: str, source: Path, line: int, vocab_size: int | None) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):  # type(): a bool is not a token
        raise DataError(source, line, field, "expected a list of integer token ids")
    if not value:
        raise DataError(source, line, field, "empty")
    if min(value) < 0:
        raise DataError(source, line, field, f"token id {min(value)} is negative")
    if vocab_size is not None and max(value) >= vocab_size:
        raise DataError(source, line, field, f"token id {max(value)} is not below the vocabulary size {vocab_size}")
    return tuple(value)


def _example_id(record: dict, line: int, source: Path) -> str:
    value = record.get("id", line)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataError(source, line, "id", f"expected a string or an integer, got {json.dumps(value)[:60]}")
    return str(value)


def _pretokenized(record: dict, line: int, source: Path, vocab_size: int | None, prefixes: dict) -> list[Example]:
    if is_group(record):
        return _pretokenized_group(record, line, source, vocab_size, prefixes)
    paired = is_pair(record)
    _keys_of(record, "pretokenized", paired, source, line)
    targets = pair_fields(record, "pretokenized", source, line) if paired else ("target_ids",)
    ids = {}
    for name in ("prefix_ids", "item_ids", *targets):
        value = _field(record, name, "pretokenized", source, line)
        if name == "item_ids" and value == []:  # an empty item is allowed; an empty P or target is not
            ids[name] = ()
            continue
        ids[name] = _token_ids(value, name, source, line, vocab_size)
    # Equal prefixes share one tuple: memory, and the planner groups them without hashing each copy.
    prefix = prefixes.setdefault(ids["prefix_ids"], ids["prefix_ids"])
    id_, weight = _example_id(record, line, source), weight_of(record, source, line)
    if not paired:
        return [Example(id_, prefix, ids["item_ids"], ids["target_ids"], str(source), line, weight=weight)]
    return [Example(f"{id_}:{side}", prefix, ids["item_ids"], ids[name], str(source), line, weight=weight, pair=id_,
                    side=side) for side, name in zip(SIDES, targets)]


def _pretokenized_group(record: dict, line: int, source: Path, vocab_size: int | None,
                        prefixes: dict) -> list[Example]:
    """A scored group's K completions as K examples sharing P and the item (:mod:`packtrain.data.scored`)."""
    completions = group_completions(record, "pretokenized", source, line)
    _known_keys(record, GROUP_KEYS["pretokenized"], "a pretokenized scored group", "", source, line)
    rewards = group_rewards(record, len(completions), source, line)
    logprobs = group_logprobs(record, len(completions), source, line)
    prefix_ids = _token_ids(_field(record, "prefix_ids", "pretokenized", source, line), "prefix_ids", source, line,
                            vocab_size)
    item = _field(record, "item_ids", "pretokenized", source, line)
    item_ids = () if item == [] else _token_ids(item, "item_ids", source, line, vocab_size)
    prefix = prefixes.setdefault(prefix_ids, prefix_ids)
    id_ = _example_id(record, line, source)
    out = []
    for i, value in enumerate(completions):
        ids = _token_ids(value, f"completion_ids[{i}]", source, line, vocab_size)
        if logprobs is not None:
            check_logprobs(logprobs[i], len(ids), i, source, line)
        out.append(Example(f"{id_}:{i}", prefix, item_ids, ids, str(source), line, group=id_, reward=rewards[i],
                           group_rewards=rewards, logprobs=None if logprobs is None else logprobs[i]))
    return out


def pretokenized_group(record: dict, line: int, source: Path, prefixes: dict) -> list[Example]:
    """A pretokenized scored group's examples, as a file's line gives them (online GRPO's rollouts,
    :mod:`packtrain.run.rollouts`)."""
    return _pretokenized_group(record, line, source, None, prefixes)


def _keys_of(record: dict, fmt: str, paired: bool, source: Path, line: int) -> None:
    """A key outside the format's (a preference pair's, when ``paired``) is refused, naming it."""
    what = f"a {fmt} preference pair" if paired else f"a {fmt} example"
    if paired:
        pair_fields(record, fmt, source, line)  # a side missing, or a target beside them: said as such
    _known_keys(record, (PAIR_KEYS if paired else EXAMPLE_KEYS)[fmt], what, "", source, line)


def _sides(record: dict, fmt: str, source: Path, line: int, conversation) -> list[Conversation]:
    """The record's conversations: one, or a pair's two (``conversation(target field)`` makes either)."""
    weight = weight_of(record, source, line)
    if not is_pair(record):
        return [dataclasses.replace(conversation("target"), weight=weight)]
    out = []
    for side, name in zip(SIDES, pair_fields(record, fmt, source, line)):
        c = conversation(name)
        out.append(dataclasses.replace(c, id=f"{c.id}:{side}", weight=weight, pair=c.id, side=side))
    return out


def _completions(record: dict, fmt: str, source: Path, line: int, conversation) -> list[Conversation]:
    """A scored group's K conversations (``conversation(field, value)`` makes the one of completion ``field``, whose
    value is ``value``), with their group, rewards and the sampler's log-probabilities."""
    completions = group_completions(record, fmt, source, line)
    _known_keys(record, GROUP_KEYS[fmt], f"a {fmt} scored group", "", source, line)
    rewards = group_rewards(record, len(completions), source, line)
    logprobs = group_logprobs(record, len(completions), source, line)
    out = []
    for k, value in enumerate(completions):
        c = conversation(f"completions[{k}]", value)
        out.append(dataclasses.replace(c, id=f"{c.id}:{k}", group=c.id, reward=rewards[k], group_rewards=rewards,
                                       logprobs=None if logprobs is None else logprobs[k]))
    return out


def _image_path(value: Any, field: str, source: Path, line: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(source, line, field, f"expected an image path, got {json.dumps(value)[:60]}")
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (Path(source).parent / path))


def _text_conversations(record: dict, line: int, source: Path) -> list[Conversation]:
    if is_group(record):
        return _completions(record, "text", source, line,
                            lambda name, value: _text_conversation({**record, name: value}, line, source, name))
    trl_pair(record, source, line)  # TRL's plain-text forms are refused with the mapping (its others are chat)
    _keys_of(record, "text", is_pair(record), source, line)
    return _sides(record, "text", source, line, lambda target: _text_conversation(record, line, source, target))


def _text_conversation(record: dict, line: int, source: Path, target_field: str) -> Conversation:
    system, item, target = (_field(record, k, "text", source, line) for k in ("system", "item", target_field))
    item = _string(item, "item", source, line)
    images = record.get("images", [])
    if not isinstance(images, list):
        raise DataError(source, line, "images", "expected a list of image paths")
    paths = [(_image_path(v, f"images[{i}]", source, line), f"images[{i}]") for i, v in enumerate(images)]
    user: Any = item
    if paths:  # the images come first, then the item's text (as Qwen's chat examples put them)
        user = [{"type": "image", "image": p} for p, _ in paths] + [{"type": "text", "text": item}]
    messages = [
        {"role": "system", "content": _string(system, "system", source, line)},
        {"role": "user", "content": user},
        {"role": "assistant", "content": _string(target, target_field, source, line, nonempty=True)},
    ]
    return Conversation(_example_id(record, line, source), line, messages, "system", target_field, paths,
                         images_through=[0, len(paths), len(paths)])


def _content(value: Any, role: str, field: str, source: Path, line: int, images: list) -> Any:
    """A message's content: a string, or (user turns) a list of text and image parts."""
    if isinstance(value, str) or role != "user":
        if not isinstance(value, str) and role == "system" and isinstance(value, list):
            raise DataError(source, line, field, "the system message must be a string: P stays text-only")
        return _string(value, field, source, line)
    if not isinstance(value, list) or not value:
        raise DataError(source, line, field, f"expected a string or a non-empty list of parts, got "
                                             f"{json.dumps(value)[:60]}")
    parts = []
    for j, part in enumerate(value):
        where = f"{field}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _string(part.get("text"), f"{where}.text", source, line)})
        elif kind == "image":
            path = _image_path(part.get("image"), f"{where}.image", source, line)
            images.append((path, f"{where}.image"))
            parts.append({"type": "image", "image": path})
        else:
            raise DataError(source, line, where, 'expected {"type": "text", "text": ...} or '
                                                 '{"type": "image", "image": path}')
    return parts


def _tools(value: Any, source: Path, line: int) -> list[dict]:
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
        raise DataError(source, line, "tools", "expected a non-empty list of JSON function schemas (objects), got "
                                               f"{json.dumps(value)[:60]}")
    return value


def _tool_calls(value: Any, field: str, source: Path, line: int) -> list[dict]:
    """The calls with their arguments as objects: arguments given as JSON text (the OpenAI wire format) are parsed
    here, since Qwen's templates iterate ``arguments|items`` and fail on a string."""
    if not isinstance(value, list) or not value:
        raise DataError(source, line, field, "expected a non-empty list of tool calls")
    calls = []
    for j, call in enumerate(value):
        where = f"{field}[{j}]"
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise DataError(source, line, where, 'expected {"type": "function", "function": {"name": str, '
                                                 '"arguments": object}}')
        where += ".function.arguments" if "function" in call else ".arguments"
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = _strict_json(arguments, source, line, where)
            except json.JSONDecodeError as e:
                raise DataError(source, line, where, f"not valid JSON text: {e.msg} (column {e.colno})") from None
        if not isinstance(arguments, dict):
            raise DataError(source, line, where, "expected a JSON object (or its text), got "
                                                 f"{json.dumps(arguments)[:60]}")
        fn = {**fn, "arguments": arguments}
        calls.append({**call, "function": fn} if "function" in call else fn)
    return calls


def _order_problem(role: str, previous: dict) -> str | None:
    """Why ``role`` may not follow the message ``previous`` (None: it may)."""
    before = previous["role"]
    if role == "assistant" and before not in ("user", "tool"):
        return (f"roles out of order: an assistant message answers a user or tool message, not the {before} message "
                "before it")
    if role == "tool" and not (before == "tool" or previous.get("tool_calls")):
        return "a tool message must follow an assistant message with tool_calls (or another tool message)"
    return None


def _chat_conversations(record: dict, line: int, source: Path) -> list[Conversation]:
    grouped = is_group(record)
    trl = None if grouped else trl_pair(record, source, line)
    if trl is not None:  # TRL's form, as packtrain's chat pair; its fields named as the file names them
        converted, file_field = trl
        try:
            conversations = _chat_conversations(converted, line, source)
        except DataError as e:
            raise DataError(source, line, file_field(e.field), e.problem) from None
        return [dataclasses.replace(c, system_field=file_field(c.system_field), target_field=file_field(c.target_field),
                                    messages_field=file_field("messages")) for c in conversations]
    paired = not grouped and is_pair(record)
    if not grouped:
        _keys_of(record, "chat", paired, source, line)
    if not paired and not grouped:
        return _sides(record, "chat", source, line, lambda _: _chat_conversation(record, line, source))
    prompt = _field(record, "messages", "chat", source, line)
    if not isinstance(prompt, list) or not prompt:
        raise DataError(source, line, "messages", "expected the prompt turns: a list of a system message and the "
                                                  "turns before the answer")

    def side(name: str, value: Any = None) -> Conversation:
        """The conversation of the answer ``name`` (its value ``value``, else the record's ``name``)."""
        answer = chat_answer(record[name] if value is None else value, name, source, line)
        try:
            c = _chat_conversation({**record, "messages": [*prompt, answer]}, line, source)
        except DataError as e:  # the answer's problem is named by its own field
            at = f"messages[{len(prompt)}]"
            if e.field is None or not e.field.startswith(at):
                raise
            raise DataError(source, line, name + e.field[len(at):], e.problem) from None
        c.target_field = name
        return c

    if grouped:
        return _completions(record, "chat", source, line, side)
    return _sides(record, "chat", source, line, side)


def _chat_conversation(record: dict, line: int, source: Path) -> Conversation:
    messages = _field(record, "messages", "chat", source, line)
    if not isinstance(messages, list) or len(messages) < 2:
        raise DataError(source, line, "messages", "expected a list of at least a system and an assistant message")
    tools = _tools(record["tools"], source, line) if record.get("tools") is not None else None
    clean, images, through = [], [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise DataError(source, line, where, "expected an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(source, line, f"{where}.role", f"expected one of {', '.join(ROLES)}, got "
                                                           f"{json.dumps(role)}")
        if i == 0 and role != "system":
            raise DataError(source, line, "messages[0].role", f"the first message must be the system message, got "
                                                               f"{role}")
        if i > 0 and role == "system":
            raise DataError(source, line, f"{where}.role", "only the first message may be a system message")
        problem = _order_problem(role, clean[-1]) if i > 0 else None
        if problem:
            raise DataError(source, line, f"{where}.role", problem)
        for key in ("reasoning_content", "tool_calls"):
            if key in m and role != "assistant":
                raise DataError(source, line, f"{where}.{key}", f"only an assistant message may carry {key} (this "
                                                                f"is a {role} message)")
        _known_keys(m, MESSAGE_KEYS[role], f"{'an' if role == 'assistant' else 'a'} {role} message", where, source,
                    line)
        out: dict[str, Any] = {"role": role}
        if role == "assistant":
            calls = _tool_calls(m["tool_calls"], f"{where}.tool_calls", source, line) if m.get("tool_calls") \
                else None
            content = m.get("content")
            out["content"] = "" if content is None and calls else _string(content, f"{where}.content", source,
                                                                          line)
            reasoning = m.get("reasoning_content")
            if reasoning is not None:
                out["reasoning_content"] = _string(reasoning, f"{where}.reasoning_content", source, line)
            if calls:
                out["tool_calls"] = calls
            if not (out["content"].strip() or (reasoning or "").strip() or calls):
                raise DataError(source, line, f"{where}.content", "an assistant turn with nothing to train on (no "
                                                                  "content, reasoning_content or tool_calls)")
        else:
            if role == "tool" and not isinstance(m.get("content"), str):
                raise DataError(source, line, f"{where}.content", "expected a string (JSON-encode a structured tool "
                                                                  f"result), got {json.dumps(m.get('content'))[:60]}")
            if "content" not in m:
                raise DataError(source, line, f"{where}.content", f"missing (a {role} message needs its content)")
            out["content"] = _content(m.get("content"), role, f"{where}.content", source, line, images)
            for key in ("name", "tool_call_id"):
                if role == "tool" and isinstance(m.get(key), str):
                    out[key] = m[key]
        if "name" in m and role != "tool":  # OpenAI's speaker name: the chat template must render it (chat.py)
            out["name"] = _string(m["name"], f"{where}.name", source, line, nonempty=True)
        clean.append(out)
        through.append(len(images))
    last = len(messages) - 1
    if clean[-1]["role"] != "assistant":
        raise DataError(source, line, f"messages[{last}].role", "the last message must be the assistant's (the "
                                                                "target)")
    return Conversation(_example_id(record, line, source), line, clean, "messages[0]", f"messages[{last}]",
                         images, tools, through)


def load_examples(path: str | Path, fmt: str | None = None, tokenizer=None, processor=None,
                  vocab_size: int | None = None, max_line_bytes: int | None = None, train_on: str = "last",
                  template_kwargs: dict | None = None, chat_template: str | Path | None = None) -> list[Example]:
    """Every example of a JSONL file; or a DataError naming every bad line (:class:`BadLines` for several: each
    line's first problem, in line order), or the file's problem (not found, empty, no chat template).

    ``tokenizer``: a tokenizer, the directory of one, or None. Text and chat need one (None: the bundled one); it is
    loaded once every line has parsed (not at all when none did). Pretokenized ids are checked against
    the vocabulary: the tokenizer's when one is given, and ``vocab_size`` (the model's embedding rows). ``processor``:
    the image processor for examples with images (an object, a local directory, or None: the bundled tiny one).
    ``max_line_bytes``: longer lines are refused unread (see :data:`LINE_BYTES_PER_TOKEN`). ``train_on`` and
    ``template_kwargs``: ``data.train_on`` and ``data.template_kwargs`` (text and chat; see the module docstring);
    ``chat_template``: a template to use instead of the tokenizer's (``data.chat_template``): its file (named in
    errors), or its text.
    """
    path = Path(path)
    records = list(_records(path, max_line_bytes))
    if not records:
        raise _empty_file(path)
    fmt = fmt or _first_format(records, path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r} (known: {', '.join(FORMATS)})")
    errors = LineErrors()

    def parsed(parse) -> list:
        """``parse(record, line)`` of every line that is a JSON object; each bad line's error collected."""
        out = []
        for line, record in records:
            if isinstance(record, DataError):
                errors.add(record)
                continue
            with errors.catch():
                out += parse(record, line)
        return out

    if fmt == "pretokenized":
        if train_on != "last":
            raise ValueError(f"data.train_on: {train_on} picks assistant turns of text or chat data; pretokenized "
                             f"examples ({path}) carry their own item and target (use train_on: last)")
        if isinstance(tokenizer, (str, Path)) and not (Path(tokenizer) / "tokenizer.json").is_file() \
                and (Path(tokenizer) / "config.json").is_file():
            # a model directory without a tokenizer: its config's vocabulary
            vocab_size = min(v for v in (vocab_size, _config_vocab_size(Path(tokenizer))) if v is not None)
            tokenizer = None
        elif isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(tokenizer)
        if tokenizer is not None:
            vocab_size = min(len(tokenizer), vocab_size or len(tokenizer))
        prefixes: dict[tuple[int, ...], tuple[int, ...]] = {}
        examples = parsed(lambda record, line: _pretokenized(record, line, path, vocab_size, prefixes))
    else:
        parse = _text_conversations if fmt == "text" else _chat_conversations
        conversations = parsed(lambda record, line: parse(record, line, path))
        paired = next((c for c in conversations if c.pair or c.group), None)
        if paired is not None and train_on != "last":
            what = ("a scored group trains its completions", "groups") if paired.group else \
                ("a preference pair trains its two answers", "pairs")
            raise DataError(path, paired.line, None, f"{what[0]}: data.train_on {train_on} is not built for "
                                                     f"{what[1]} (use train_on: last)")
        examples = []
        if conversations:  # a file of bad lines only is refused as such, without the tokenizer
            if tokenizer is None or isinstance(tokenizer, (str, Path)):
                tokenizer = load_tokenizer(tokenizer)
            if isinstance(processor, (str, Path)):
                from packtrain.data.images import load_image_processor

                processor = load_image_processor(processor)
            examples = tokenize(conversations, tokenizer, path, errors, processor, train_on, template_kwargs,
                                chat_template)
    check_pairs(examples, path, dict(zip(SIDES, SIDE_FIELDS[fmt])), errors)
    check_groups(examples, path, fmt, errors)
    seen: dict[str, int] = {}
    for ex in examples:
        if ex.id in seen:
            errors.add(DataError(path, ex.line, "id", f"{ex.id!r} is also the id of line {seen[ex.id]}"))
        seen.setdefault(ex.id, ex.line)
    errors.raise_any()
    return examples


def _config_vocab_size(model_dir: Path) -> int | None:
    """The vocabulary of a model directory's config.json (a vision-language config keeps it in text_config)."""
    raw = json.loads((model_dir / "config.json").read_text())
    return (raw.get("text_config") or {}).get("vocab_size") or raw.get("vocab_size")


def load_split(cfg: Config, split: str, tokenizer=None) -> list[Example] | None:
    """The examples of ``data.train`` or ``data.eval`` (None when that split is not configured).

    The tokenizer: the one given, else ``data.tokenizer``, else the model's directory, else (text and chat only) the
    bundled one.
    """
    path = cfg.resolve_path(getattr(cfg.data, split))
    if path is None:
        return None
    if tokenizer is None:
        tokenizer = cfg.resolve_path(cfg.data.tokenizer or cfg.model.path)
    max_line_bytes = LINE_BYTES_PER_TOKEN * cfg.packing.token_budget
    fmt = cfg.data.format or (detect_format(path, max_line_bytes) if path.is_file() else None)
    vocab_size = model_vocab_size(cfg) if fmt == "pretokenized" else None
    return load_examples(path, fmt, tokenizer, processor_dir(cfg), vocab_size=vocab_size,
                         max_line_bytes=max_line_bytes, train_on=cfg.data.train_on,
                         template_kwargs=cfg.data.template_kwargs, chat_template=chat_template_of(cfg))


def tokenizer_dir(cfg: Config) -> Path:
    """The tokenizer directory whose files text and chat data are tokenized with, as :func:`load_split` picks it:
    ``data.tokenizer``, else ``model.path``, else the bundled tokenizer."""
    return cfg.resolve_path(cfg.data.tokenizer or cfg.model.path) or BUNDLED_TOKENIZER


def chat_template_of(cfg: Config) -> Path | None:
    """The file of ``data.chat_template`` (None: the tokenizer's own template)."""
    path = cfg.resolve_path(cfg.data.chat_template)
    if path is None:
        return None
    if not path.is_file():
        raise ValueError(f"data.chat_template: no such file {path}")
    return path


def model_vocab_size(cfg: Config) -> int | None:
    """Rows of the model's token embedding, from ``model.config`` or ``model.path``'s config.json: a larger id
    would fail mid-run inside the embedding. None when the model config is unusable (building the model says why)."""
    from transformers import AutoConfig

    try:
        if cfg.model.config is not None:
            raw = dict(cfg.model.config)
            hf_config = AutoConfig.for_model(raw.pop("model_type"), **raw)
        elif cfg.model.path is not None and (cfg.resolve_path(cfg.model.path) / "config.json").is_file():
            hf_config = AutoConfig.from_pretrained(cfg.resolve_path(cfg.model.path), local_files_only=True)
        else:
            return None
    except (KeyError, TypeError, ValueError):
        return None
    return hf_config.get_text_config().vocab_size


def processor_dir(cfg: Config) -> Path | None:
    """``data.processor``, else the model's directory when it has an image processor, else None (bundled)."""
    if cfg.data.processor:
        return cfg.resolve_path(cfg.data.processor)
    model_dir = cfg.resolve_path(cfg.model.path)
    if model_dir is not None and (model_dir / "preprocessor_config.json").is_file():
        return model_dir
    return None
