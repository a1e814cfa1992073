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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from packtrain.config import Config

from packtrain.data.images import IMAGE_PAD, ImageRef

FORMATS = ("text", "chat", "pretokenized")
BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
ROLES = ("system", "user", "assistant")
# A JSON line holding an example that fits a pack of B tokens has fewer than this many bytes per token of B: text
# averages about 4 bytes per token, JSON-escaped CJK (\\uXXXX) about 9, pre-tokenized ids ("12345, ") up to 8.
LINE_BYTES_PER_TOKEN = 32


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
    images: tuple[ImageRef, ...] = ()  # images of the item, in order; their tokens are counted in item_ids

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
    messages: list[dict]
    system_field: str
    target_field: str
    images: list[tuple[str, str]] = field(default_factory=list)  # (resolved path, field) in order of appearance


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


def _records(path: Path, max_line_bytes: int | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for each non-blank line; a line over ``max_line_bytes`` is refused before it is
    read whole, parsed or tokenized: its error costs neither the time nor the memory of reading it
    (docs/performance.md, "Refusing an oversized line")."""
    if not path.is_file():
        raise DataError(path, None, None, "file not found")
    limit = -1 if max_line_bytes is None else max_line_bytes + 1
    with path.open("rb") as f:
        for line_no, line in enumerate(iter(lambda: f.readline(limit), b""), 1):
            if max_line_bytes is not None and len(line.rstrip(b"\r\n")) > max_line_bytes:
                raise DataError(path, line_no, None, f"line longer than {max_line_bytes:,} bytes: "
                                f"{LINE_BYTES_PER_TOKEN} bytes per token of packing.token_budget, more than any "
                                "example that fits a pack (a missing newline joins lines)")
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


def detect_format(path: str | Path, max_line_bytes: int | None = None) -> str:
    """The format of a JSONL file, from the keys of its first example."""
    path = Path(path)
    for line, record in _records(path, max_line_bytes):
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


def _image_path(value: Any, field: str, source: Path, line: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(source, line, field, f"expected an image path, got {json.dumps(value)[:60]}")
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (Path(source).parent / path))


def _text_conversation(record: dict, line: int, source: Path) -> _Conversation:
    system, item, target = (_field(record, k, "text", source, line) for k in ("system", "item", "target"))
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
        {"role": "assistant", "content": _string(target, "target", source, line, nonempty=True)},
    ]
    return _Conversation(_example_id(record, line, source), line, messages, "system", "target", paths)


def _content(value: Any, role: str, field: str, source: Path, line: int, images: list) -> Any:
    """A message's content: a string, or (user turns) a list of text and image parts."""
    if isinstance(value, str) or role != "user":
        if not isinstance(value, str) and role == "system" and isinstance(value, list):
            raise DataError(source, line, field, "the system message must be a string: P stays text-only")
        return _string(value, field, source, line)
    if not isinstance(value, list) or not value:
        raise DataError(source, line, field, "expected a string or a non-empty list of parts")
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


def _chat_conversation(record: dict, line: int, source: Path) -> _Conversation:
    messages = _field(record, "messages", "chat", source, line)
    if not isinstance(messages, list) or len(messages) < 2:
        raise DataError(source, line, "messages", "expected a list of at least a system and an assistant message")
    clean, images = [], []
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
        content = _content(m.get("content"), role, f"messages[{i}].content", source, line, images)
        clean.append({"role": role, "content": content})
    last = len(messages) - 1
    if clean[-1]["role"] != "assistant":
        raise DataError(source, line, f"messages[{last}].role", "the last message must be the assistant's (the "
                                                                "target)")
    _string(clean[-1]["content"], f"messages[{last}].content", source, line, nonempty=True)
    return _Conversation(_example_id(record, line, source), line, clean, "messages[0]", f"messages[{last}]",
                         images)


def _render(tokenizer, messages: list[dict], generation_prompt: bool, source: Path, conv: _Conversation) -> str:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except (TemplateError, TypeError) as e:  # TypeError: a string-only template given a list of parts
        raise DataError(source, conv.line, "messages", f"the chat template refused it: {e}") from None


def _image_grids(conversations: list[_Conversation], processor, source: Path) -> dict[str, tuple[int, int, int]]:
    """The patch grid of every distinct image (each is read once); a missing or unreadable image is a DataError
    naming the file, line and field of its first use."""
    from packtrain.data.images import open_image

    grids: dict[str, tuple[int, int, int]] = {}
    for c in conversations:
        for path, where in c.images:
            if path in grids:
                continue
            if not Path(path).is_file():
                raise DataError(source, c.line, where, f"image not found: {path}")
            try:
                image = open_image(path)
                grid = processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
            except Exception as e:  # noqa: BLE001 - any decoder error means the same thing to the user
                raise DataError(source, c.line, where, f"cannot read image {path}: {e}") from None
            grids[path] = tuple(int(v) for v in grid)
    return grids


def _expand_images(ids: list[int], c: _Conversation, grids: dict, pad_id: int, merge: int, source: Path,
                   field_name: str) -> list[int]:
    """One image-pad token per image (as the template renders it) -> T*H*W/merge^2 of them."""
    out, k = [], 0
    for t in ids:
        if t != pad_id:
            out.append(t)
            continue
        if k >= len(c.images):
            raise DataError(source, c.line, field_name, "the text holds more image placeholders than images")
        gt, gh, gw = grids[c.images[k][0]]
        out.extend([pad_id] * (gt * gh * gw // merge ** 2))
        k += 1
    return out


def _tokenize(conversations: list[_Conversation], tokenizer, source: Path, processor=None) -> list[Example]:
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer {tokenizer.name_or_path} has no chat template: text and chat data need one")

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    grids: dict = {}
    pad_id = None
    if any(c.images for c in conversations):
        from packtrain.data.images import load_image_processor

        pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if pad_id is None or pad_id == tokenizer.unk_token_id or IMAGE_PAD not in tokenizer.get_vocab():
            raise ValueError(f"the tokenizer {tokenizer.name_or_path} has no {IMAGE_PAD} token: examples with "
                             "images need a vision-language tokenizer (data.tokenizer)")
        processor = processor if processor is not None else load_image_processor(None)
        grids = _image_grids(conversations, processor, source)

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
        item, target = prompt[len(prefix):], full[len(prompt):]
        refs: tuple[ImageRef, ...] = ()
        if c.images:
            if pad_id in target:
                raise DataError(source, c.line, c.target_field, "the target holds an image placeholder")
            if item.count(pad_id) != len(c.images):
                raise DataError(source, c.line, "messages", f"{len(c.images)} images but {item.count(pad_id)} "
                                                            "image placeholders after rendering the chat template")
            item = _expand_images(item, c, grids, pad_id, processor.merge_size, source, "messages")
            refs = tuple(ImageRef(path, grids[path]) for path, _ in c.images)
        examples.append(Example(c.id, prefix, tuple(item), tuple(target), str(source), c.line, refs))
    return examples


def load_examples(path: str | Path, fmt: str | None = None, tokenizer=None, processor=None,
                  vocab_size: int | None = None, max_line_bytes: int | None = None) -> list[Example]:
    """Every example of a JSONL file, or a DataError for the first bad one.

    ``tokenizer``: a tokenizer, the directory of one, or None. Text and chat need one (None: the bundled one); it is
    loaded only once every line has parsed, so a malformed file fails fast. Pretokenized ids are checked against
    the vocabulary: the tokenizer's when one is given, and ``vocab_size`` (the model's embedding rows). ``processor``:
    the image processor for examples with images (an object, a local directory, or None: the bundled tiny one).
    ``max_line_bytes``: longer lines are refused unread (see :data:`LINE_BYTES_PER_TOKEN`).
    """
    path = Path(path)
    records = list(_records(path, max_line_bytes))
    if not records:
        raise _empty_file(path)
    fmt = fmt or _format_of(records[0][1], path, records[0][0])
    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r} (known: {', '.join(FORMATS)})")
    if fmt == "pretokenized":
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
        examples = [_pretokenized(r, line, path, vocab_size, prefixes) for line, r in records]
    else:
        parse = _text_conversation if fmt == "text" else _chat_conversation
        conversations = [parse(r, line, path) for line, r in records]
        if tokenizer is None or isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(tokenizer)
        if isinstance(processor, (str, Path)):
            from packtrain.data.images import load_image_processor

            processor = load_image_processor(processor)
        examples = _tokenize(conversations, tokenizer, path, processor)
    seen: dict[str, int] = {}
    for ex in examples:
        if ex.id in seen:
            raise DataError(path, ex.line, "id", f"{ex.id!r} is also the id of line {seen[ex.id]}")
        seen[ex.id] = ex.line
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
                         max_line_bytes=max_line_bytes)


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
