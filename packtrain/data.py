"""Examples from JSONL, one per line, each split into a shared prefix P, an item and a target.

Three formats (``data.format``; detected from the first line when omitted):

- text: ``{"id"?, "system": str, "item": str, "target": str}``
- chat: ``{"id"?, "messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``, one system
  message first, the final assistant message is the target
- pretokenized: ``{"id"?, "prefix_ids": [int], "item_ids": [int], "target_ids": [int]}``

Text and chat go through the tokenizer's chat template. P is the system turn rendered alone; the item is everything
after it up to and including the generation prompt (``<|im_start|>assistant\\n``); the target is the rest of the
whole conversation, so it includes the closing ``<|im_end|>`` and newline as the template renders them: the model
learns to stop. A text example is the chat [system, user=item, assistant=target]. In a chat with several turns the
earlier user and assistant turns belong to the item and carry no loss.

Each piece is tokenized on its own, so the pieces must concatenate to the tokens of the whole example: P's tokens
must be a prefix of the prompt's and the prompt's of the whole conversation's. An example where the tokenizer merges
across a boundary is refused, naming its file, line and field. The loss is on the target tokens only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from packtrain.config import Config

FORMATS = ("text", "chat", "pretokenized")
BUNDLED_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tokenizer"
ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """An unusable example or data file; the message names the file, the line and the field."""

    def __init__(self, source: str | Path, line: int | None, field: str | None, problem: str):
        self.source, self.line, self.field = str(source), line, field
        where = f"{source}:{line}" if line else str(source)
        what = f" field '{field}':" if field else ""
        super().__init__(f"{where}:{what} {problem}")


@dataclass(frozen=True)
class Example:
    id: str
    prefix_ids: tuple[int, ...]
    item_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    source: str = ""
    line: int = 0

    @property
    def continuation_ids(self) -> tuple[int, ...]:
        return self.item_ids + self.target_ids

    @property
    def len_continuation(self) -> int:
        return len(self.item_ids) + len(self.target_ids)


@dataclass
class _Conversation:
    """A text or chat record before tokenization, with the names its pieces have in the file (for errors)."""

    id: str
    line: int
    messages: list[dict[str, str]]
    system_field: str
    target_field: str


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A local tokenizer directory (nothing is downloaded); None: the small tokenizer bundled for demos and tests.

    The generic fast class reads any directory with a tokenizer.json (a Qwen checkpoint has one) and imports in
    about a second, where AutoTokenizer's import takes over three.
    """
    from transformers import PreTrainedTokenizerFast

    path = Path(path) if path is not None else BUNDLED_TOKENIZER
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer.json in the tokenizer directory {path}")
    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)


def _records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for each non-blank line."""
    if not path.is_file():
        raise DataError(path, None, None, "file not found")
    with path.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except UnicodeDecodeError:
                raise DataError(path, line_no, None, "not valid UTF-8") from None
            except json.JSONDecodeError as e:
                raise DataError(path, line_no, None, f"not valid JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(path, line_no, None, f"expected a JSON object, got {type(record).__name__}")
            yield line_no, record


def _empty_file(path: Path) -> DataError:
    return DataError(path, None, None, "empty file: no examples")


def _format_of(record: dict, source: Path, line: int) -> str:
    if "messages" in record:
        return "chat"
    if "prefix_ids" in record:
        return "pretokenized"
    if "system" in record or "target" in record:
        return "text"
    raise DataError(source, line, None, f"cannot tell the format from the keys {sorted(record)}: expected "
                                        "system/item/target (text), messages (chat) or prefix_ids/item_ids/"
                                        "target_ids (pretokenized)")


def detect_format(path: str | Path) -> str:
    """The format of a JSONL file, from the keys of its first example."""
    path = Path(path)
    for line, record in _records(path):
        return _format_of(record, path, line)
    raise _empty_file(path)


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


def _pretokenized(record: dict, line: int, source: Path, vocab_size: int | None, prefixes: dict) -> Example:
    ids = {}
    for name in ("prefix_ids", "item_ids", "target_ids"):
        value = _field(record, name, "pretokenized", source, line)
        if name == "item_ids" and value == []:  # an empty item is allowed; an empty P or target is not
            ids[name] = ()
            continue
        ids[name] = _token_ids(value, name, source, line, vocab_size)
    # Equal prefixes share one tuple: memory, and the planner groups them without hashing each copy.
    prefix = prefixes.setdefault(ids["prefix_ids"], ids["prefix_ids"])
    return Example(_example_id(record, line, source), prefix, ids["item_ids"], ids["target_ids"], str(source), line)


def _text_conversation(record: dict, line: int, source: Path) -> _Conversation:
    system, item, target = (_field(record, k, "text", source, line) for k in ("system", "item", "target"))
    messages = [
        {"role": "system", "content": _string(system, "system", source, line)},
        {"role": "user", "content": _string(item, "item", source, line)},
        {"role": "assistant", "content": _string(target, "target", source, line, nonempty=True)},
    ]
    return _Conversation(_example_id(record, line, source), line, messages, "system", "target")


def _chat_conversation(record: dict, line: int, source: Path) -> _Conversation:
    messages = _field(record, "messages", "chat", source, line)
    if not isinstance(messages, list) or len(messages) < 2:
        raise DataError(source, line, "messages", "expected a list of at least a system and an assistant message")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(source, line, f"messages[{i}]", "expected an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(source, line, f"messages[{i}].role", f"expected one of {', '.join(ROLES)}, got "
                                                                  f"{json.dumps(role)}")
        if i == 0 and role != "system":
            raise DataError(source, line, "messages[0].role", f"the first message must be the system message, got "
                                                               f"{role}")
        if i > 0 and role == "system":
            raise DataError(source, line, f"messages[{i}].role", "only the first message may be a system message")
        clean.append({"role": role, "content": _string(m.get("content"), f"messages[{i}].content", source, line)})
    last = len(messages) - 1
    if clean[-1]["role"] != "assistant":
        raise DataError(source, line, f"messages[{last}].role", "the last message must be the assistant's (the "
                                                                "target)")
    _string(clean[-1]["content"], f"messages[{last}].content", source, line, nonempty=True)
    return _Conversation(_example_id(record, line, source), line, clean, "messages[0]", f"messages[{last}]")


def _render(tokenizer, messages: list[dict], generation_prompt: bool, source: Path, conv: _Conversation) -> str:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as e:
        raise DataError(source, conv.line, "messages", f"the chat template refused it: {e}") from None


def _tokenize(conversations: list[_Conversation], tokenizer, source: Path) -> list[Example]:
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer {tokenizer.name_or_path} has no chat template: text and chat data need one")

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    p_texts, prompt_texts, full_texts = [], [], []
    for c in conversations:
        p_texts.append(_render(tokenizer, c.messages[:1], False, source, c))
        prompt_texts.append(_render(tokenizer, c.messages[:-1], True, source, c))
        full_texts.append(_render(tokenizer, c.messages, False, source, c))
    # One tokenization per distinct P: its examples share the resulting tuple.
    distinct_p = sorted(set(p_texts))
    p_ids = {text: tuple(ids) for text, ids in zip(distinct_p, encode(distinct_p))}

    examples = []
    for c, p_text, prompt_text, full_text, prompt, full in zip(
        conversations, p_texts, prompt_texts, full_texts, encode(prompt_texts), encode(full_texts)
    ):
        prefix = p_ids[p_text]
        if not (prompt_text.startswith(p_text) and full_text.startswith(prompt_text)):
            raise DataError(source, c.line, c.system_field, "the chat template renders the system turn or the "
                                                            "prompt differently inside the whole conversation")
        if tuple(prompt[: len(prefix)]) != prefix:
            raise DataError(source, c.line, c.system_field, "the system turn's tokens are not a prefix of the whole "
                                                            "example's tokens (the tokenizer merges across the end "
                                                            "of the system turn)")
        if full[: len(prompt)] != prompt:
            raise DataError(source, c.line, c.target_field, "the prompt's tokens are not a prefix of the whole "
                                                            "example's tokens (the tokenizer merges across the "
                                                            "start of the target)")
        examples.append(Example(c.id, prefix, tuple(prompt[len(prefix):]), tuple(full[len(prompt):]), str(source),
                                c.line))
    return examples


def load_examples(path: str | Path, fmt: str | None = None, tokenizer=None) -> list[Example]:
    """Every example of a JSONL file, or a DataError for the first bad one.

    ``tokenizer``: a tokenizer, the directory of one, or None. Text and chat need one (None: the bundled one); it is
    loaded only once every line has parsed, so a malformed file fails fast. Pretokenized ids are checked against
    the vocabulary when a tokenizer is given.
    """
    path = Path(path)
    records = list(_records(path))
    if not records:
        raise _empty_file(path)
    fmt = fmt or _format_of(records[0][1], path, records[0][0])
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r} (known: {', '.join(FORMATS)})")
    if fmt == "pretokenized":
        if isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(tokenizer)
        vocab_size = len(tokenizer) if tokenizer is not None else None
        prefixes: dict[tuple[int, ...], tuple[int, ...]] = {}
        examples = [_pretokenized(r, line, path, vocab_size, prefixes) for line, r in records]
    else:
        parse = _text_conversation if fmt == "text" else _chat_conversation
        conversations = [parse(r, line, path) for line, r in records]
        if tokenizer is None or isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(tokenizer)
        examples = _tokenize(conversations, tokenizer, path)
    seen: dict[str, int] = {}
    for ex in examples:
        if ex.id in seen:
            raise DataError(path, ex.line, "id", f"{ex.id!r} is also the id of line {seen[ex.id]}")
        seen[ex.id] = ex.line
    return examples


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
    return load_examples(path, cfg.data.format, tokenizer)
