"""Text and chat examples through the chat template: P (the system block), the prompt and the text of each trained
assistant turn per ``data.train_on``, tokenized as the model reads and generates them (see
:mod:`packtrain.data.jsonl` for the formats and the rules; docs/design.md, "Chat data")."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from packtrain.data.example import Conversation, DataError, Example, LineErrors
from packtrain.data.images import IMAGE_PAD, ImageRef

TRAIN_ON = ("last", "all", "each")


@dataclass
class _Render:
    """One example's texts before tokenization: P, the whole, and per trained turn its prompt (the conversation
    before it, through the generation prompt) and the text through it (the whole, for the last message)."""
    conv: Conversation
    id: str
    p: str
    whole: str
    turns: list[tuple[int, str, str]]  # (message index, prompt, text through the turn)
    n_images: int


@dataclass
class _Template:
    """The chat template as packtrain calls it: the tokenizer, ``data.template_kwargs`` (with ``data.chat_template``'s
    text when it replaces the tokenizer's), the template's name for errors, and P's text per system text and tools
    (and the user turn's header that P ends before)."""
    tokenizer: Any
    kwargs: dict
    name: str
    prefixes: dict = field(default_factory=dict)
    user_header: str | None = None
    owners: dict = field(default_factory=dict)  # P's text -> the first (system text, tools) and line rendering it

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.kwargs)


def _template_name(tokenizer, chat_template: str | Path | None) -> str:
    if isinstance(chat_template, Path):
        return str(chat_template)
    if chat_template is not None:
        return "data.chat_template"
    own = Path(tokenizer.name_or_path or ".") / "chat_template.jinja"
    return str(own) if own.is_file() else f"the chat template of the tokenizer {tokenizer.name_or_path}"


def _refusal(t: _Template, c: Conversation, upto: int, error: Exception, source: Path) -> DataError:
    """The template's own error, on the first message whose addition makes it raise (the conversation through the
    first user message is the shortest a template must accept)."""
    from jinja2 import TemplateError

    failed, where = upto - 1, "with the generation prompt after"
    for i in range(2, upto + 1):
        try:
            t.render(c.messages[:i], c.tools)
        except (TemplateError, TypeError):
            failed, where = i - 1, "on"
            break
    name = c.message_field(failed)
    return DataError(source, c.line, name, f"the chat template {t.name} raised {where} {name}: {error}")


def _render(t: _Template, c: Conversation, upto: int, generation_prompt: bool, source: Path) -> str:
    """``c.messages[:upto]`` as the template renders it."""
    from jinja2 import TemplateError

    try:
        return t.render(c.messages[:upto], c.tools, generation_prompt)
    except (TemplateError, TypeError) as e:  # TypeError: a string-only template given a list of parts
        raise _refusal(t, c, upto, e, source) from None


def _prefix_text(t: _Template, c: Conversation, tools: list[dict] | None, source: Path) -> str:
    """P's text: what the template writes before the first user turn, found without rendering the system message
    alone (Qwen's official templates refuse a conversation without a user query). Two renders that differ only in
    the first user message's text agree up to that text: the system block and the user turn's header; the header
    is what they agree on without the system message and tools. One per system text and tools: they share P."""
    from jinja2 import TemplateError

    key = (c.messages[0]["content"], c.messages[0].get("name"), json.dumps(tools, sort_keys=True) if tools else None)
    if key in t.prefixes:
        return t.prefixes[key]

    def before_user(head: list[dict], tools) -> str:
        a, b = (t.render([*head, {"role": "user", "content": text}], tools) for text in ("a", "b"))
        return os.path.commonprefix([a, b])

    try:
        block = before_user(c.messages[:1], tools)
        if t.user_header is None:
            t.user_header = before_user([], None)
    except (TemplateError, TypeError) as e:
        raise DataError(source, c.line, "tools" if tools else c.system_field,
                        f"the chat template {t.name} raised on the system message{' and tools' * bool(tools)} "
                        f"followed by a user message: {e}") from None
    shared = len(os.path.commonprefix([block[::-1], t.user_header[::-1]]))
    t.prefixes[key] = block[: len(block) - shared]
    return t.prefixes[key]


def _check_prefix(t: _Template, c: Conversation, p: str, source: Path) -> None:
    """P must hold the system text it was given, and different system texts (or tools) must not share one P: a
    template that drops the system message would train every prompt as one, with nothing of any."""
    system = c.messages[0]["content"].strip()  # the official templates trim it
    key = (system, json.dumps(c.tools, sort_keys=True) if c.tools else None)
    first = t.owners.get(p)
    if first is not None:
        if first[0] != key:
            where, what = ((c.system_field, "system text differs") if first[0][0] != system else
                           ("tools", "tools differ"))
            raise DataError(source, c.line, where, f"the chat template {t.name} renders this example's P as line "
                                                   f"{first[1]}'s, whose {what}: different prompts would train as one")
        return
    if not p:
        raise DataError(source, c.line, c.system_field, f"the chat template {t.name} renders nothing before the "
                                                        "first user turn: P (the system block) would be empty "
                                                        "(a template that drops the system message?)")
    if system not in p:
        raise DataError(source, c.line, c.system_field, f"the chat template {t.name} does not render this system "
                                                        "text before the first user turn: P would lose it (a "
                                                        "template that drops or rewrites the system message?)")
    t.owners[p] = (key, c.line)


def _renders(c: Conversation, t: _Template, source: Path, train_on: str) -> list[_Render]:
    """The examples of one conversation under ``data.train_on``, as texts."""
    def render(upto: int, prompt: bool = False) -> str:
        return _render(t, c, upto, prompt, source)

    _check_names(t, c, source)
    p = _prefix_text(t, c, c.tools, source)
    if c.tools is not None and p == _prefix_text(t, c, None, source):
        raise DataError(source, c.line, "tools", f"the chat template {t.name} does not render tools: P would "
                                                 "silently lose them (use a template that renders `tools`, as "
                                                 "Qwen's does)")
    _check_prefix(t, c, p, source)
    assistant = [i for i, m in enumerate(c.messages) if m["role"] == "assistant"]
    last = len(c.messages) - 1
    if train_on == "each":
        several = len(assistant) > 1
        out = []
        for n, k in enumerate(assistant, 1):
            through = render(k + 1)
            out.append(_Render(c, f"{c.id}#{n}" if several else c.id, p, through, [(k, render(k, True), through)],
                               c.images_through[k]))
        return out
    whole = render(last + 1)
    trained = assistant if train_on == "all" else [last]
    turns = [(k, render(k, True), whole if k == last else render(k + 1)) for k in trained]
    return [_Render(c, c.id, p, whole, turns, len(c.images))]


# What a message's name is in the render that finds the names a template drops: text no template writes by itself
NAME_MARK = "\u2063name{}\u2063"  # U+2063, the invisible separator


def _check_names(t: _Template, c: Conversation, source: Path) -> None:
    """A message's ``name`` (OpenAI's speaker name) must reach the rendered text, or the template would drop it
    silently: one render with each name replaced by a mark of its own finds a name the template does not write."""
    named = [k for k, m in enumerate(c.messages) if "name" in m and m["role"] != "tool"]
    if not named:
        return
    probe = [{**m, "name": NAME_MARK.format(k)} if k in named else m for k, m in enumerate(c.messages)]
    text = _render(t, replace(c, messages=probe), len(probe), False, source)
    dropped = next((k for k in named if NAME_MARK.format(k) not in text), None)
    if dropped is not None:
        raise DataError(source, c.line, f"{c.message_field(dropped)}.name", f"the chat template {t.name} does not "
                        "render a message's name: it would be dropped (give data.chat_template, a template that "
                        "writes message.name, or leave name out)")


def _history_rewritten(turn: str, name: str) -> str:
    return (f"train_on: all cannot find assistant turn {turn} in the whole conversation: the chat template "
            f"{name} renders the conversation up to it differently once later turns follow (it rewrites history, as "
            "Qwen's does with reasoning before the last user message); data.train_on: each trains it (one example "
            "per turn, its history rendered as when generating it)")


def _has_reasoning(message: dict) -> bool:
    return bool((message.get("reasoning_content") or "").strip()) or "</think>" in message["content"]


def _prompt_conflict(c: Conversation, k: int, t: _Template, source: Path) -> DataError:
    """Why assistant turn ``k``'s text does not start with its generation prompt."""
    m, kwargs, name = c.messages[k], t.kwargs, t.name
    if "name" in m:  # a template that writes names in a turn's header: the generation prompt has none
        nameless = replace(c, messages=[*c.messages[:k], {key: v for key, v in m.items() if key != "name"}])
        if _render(t, nameless, k + 1, False, source).startswith(_render(t, nameless, k, True, source)):
            return DataError(source, c.line, f"{c.message_field(k)}.name", f"the chat template {name} writes this "
                             "assistant turn's name where its generation prompt has none: the model cannot be trained "
                             "to generate it (leave name out of a trained assistant turn)")
    if kwargs.get("enable_thinking") is False and _has_reasoning(m):
        where = (f"{c.message_field(k)}.reasoning_content" if (m.get("reasoning_content") or "").strip() else
                 c.target_field if c.system_field == "system" else f"{c.message_field(k)}.content")  # inline <think>
        return DataError(source, c.line, where, "this assistant turn carries reasoning, but data.template_kwargs "
                                                  "sets enable_thinking: false (its generation prompt closes an empty "
                                                  "think block): drop the reasoning, or train it with thinking on")
    return DataError(source, c.line, c.message_field(k), f"the chat template {name} renders this assistant turn "
                                                          "without its own generation prompt before it: no split into "
                                                          "prompt and target is what the model reads")


def _image_grids(conversations: list[Conversation], processor, source: Path,
                 errors: LineErrors) -> dict[str, tuple[int, int, int]]:
    """The patch grid of every distinct image (each is read once); a missing or unreadable image is the error of
    each line that uses it, naming its field."""
    from packtrain.data.images import open_image

    grids: dict[str, tuple[int, int, int]] = {}
    unusable: dict[str, str] = {}  # path -> why
    for c in conversations:
        for path, where in c.images:
            if path not in grids and path not in unusable and not Path(path).is_file():
                unusable[path] = f"image not found: {path}"
            elif path not in grids and path not in unusable:  # read once
                try:
                    grid = processor(images=[open_image(path)], return_tensors="pt")["image_grid_thw"][0]
                    grids[path] = tuple(int(v) for v in grid)
                except Exception as e:  # noqa: BLE001 - any decoder error means the same thing to the user
                    unusable[path] = f"cannot read image {path}: {e}"
            if path in unusable:
                errors.add(DataError(source, c.line, where, unusable[path]))
    return grids


def _expand_images(ids: list[int], images: list[tuple[str, str]], grids: dict, pad_id: int,
                   merge: int) -> tuple[list[int], list[int]]:
    """One image-pad token per image (as the template renders it) -> T*H*W/merge^2 of them; and where each index of
    ``ids`` (and its end) lands in the result."""
    out, where, k = [], [], 0
    for t in ids:
        where.append(len(out))
        if t != pad_id:
            out.append(t)
            continue
        gt, gh, gw = grids[images[k][0]]
        out.extend([pad_id] * (gt * gh * gw // merge ** 2))
        k += 1
    where.append(len(out))
    return out, where


def read_template(path: Path) -> str:
    """The text of ``data.chat_template``'s file; a file that is not UTF-8 is refused naming it and the key (the
    decoder's own error named neither)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data.chat_template: {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                         f"{e.start}): a Jinja template is text; save it as UTF-8") from None


def tokenize(conversations: list[Conversation], tokenizer, source: Path, errors: LineErrors, processor=None,
             train_on: str = "last", template_kwargs: dict | None = None,
             chat_template: str | Path | None = None) -> list[Example]:
    """The examples of the lines whose conversations all render and tokenize; each other line's first problem goes
    to ``errors``. A problem of the template or the tokenizer themselves is raised (a ValueError)."""
    if not (chat_template or tokenizer.chat_template):
        raise ValueError(f"the tokenizer {tokenizer.name_or_path} has no chat template: text and chat data need one "
                         "(or data.chat_template)")
    text = read_template(chat_template) if isinstance(chat_template, Path) else chat_template
    if text is not None and not text.strip():  # else the tokenizer's own template would be used, silently
        raise ValueError(f"data.chat_template: {_template_name(tokenizer, chat_template)} is empty: give a Jinja "
                         "chat template, or leave data.chat_template unset for the tokenizer's own")
    t = _Template(tokenizer, {**(template_kwargs or {}), **({"chat_template": text} if text else {})},
                  _template_name(tokenizer, chat_template))
    if train_on not in TRAIN_ON:
        raise ValueError(f"unknown data.train_on {train_on!r} (known: {', '.join(TRAIN_ON)})")
    grids: dict = {}
    pad_id = None
    if any(c.images for c in conversations):
        from packtrain.data.images import load_image_processor

        pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if pad_id is None or pad_id == tokenizer.unk_token_id or IMAGE_PAD not in tokenizer.get_vocab():
            raise ValueError(f"the tokenizer {tokenizer.name_or_path} has no {IMAGE_PAD} token: examples with "
                             "images need a vision-language tokenizer (data.tokenizer)")
        processor = processor if processor is not None else load_image_processor(None)
        grids = _image_grids(conversations, processor, source, errors)

    renders: list[_Render] = []
    for c in conversations:  # text first: cheap, and a rewritten history is named before anything is tokenized
        if c.line not in errors:  # a pair's other side, or an image, made the line bad already
            with errors.catch():
                renders += _checked(_renders(c, t, source, train_on), t, source, train_on)
    renders = [r for r in renders if r.conv.line not in errors]
    # One tokenization per distinct text: equal P's (and histories) share the resulting tuple.
    texts = sorted({x for r in renders for x in (r.p, r.whole, *(piece for k, prompt, through in r.turns
                                                                  for piece in (prompt, through[len(prompt):])))})
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    ids = {text: tuple(e) for text, e in zip(texts, encoded)}
    examples = []
    for r in renders:
        with errors.catch():
            examples.append(_example(r, ids, t, source, pad_id, grids, processor))
    return [ex for ex in examples if ex.line not in errors]


def _checked(renders: list[_Render], t: _Template, source: Path, train_on: str) -> list[_Render]:
    """``renders``, once each is found to split as the model reads it: P starts the whole and every prompt, each
    trained turn's text starts with its prompt, and (``all``) each turn's text starts the whole."""
    for r in renders:
        c = r.conv
        if not r.whole.startswith(r.p):
            raise DataError(source, c.line, c.system_field, "the chat template renders the system turn differently "
                                                            "inside the whole conversation")
        for k, prompt, through in r.turns:
            if not through.startswith(prompt):
                raise _prompt_conflict(c, k, t, source)
            if not prompt.startswith(r.p):
                raise DataError(source, c.line, c.system_field, "the chat template renders the system turn "
                                                                f"differently in the prompt of {c.message_field(k)}")
            if train_on == "all" and not r.whole.startswith(through):
                raise DataError(source, c.line, c.message_field(k), _history_rewritten(c.message_field(k), t.name))
    return renders


def _merge_fix(c: Conversation, j: int, kwargs: dict) -> str:
    """What trains a conversation whose turn ``j`` tokenizes differently inside a later turn's prompt."""
    fix = "data.train_on: each trains it (one example per turn, each tokenized as the model reads it then)"
    if kwargs.get("enable_thinking") is not False and not _has_reasoning(c.messages[j]):
        fix += ("; or data.template_kwargs: {enable_thinking: false}, which puts the empty think block of a turn "
                "without reasoning in its prompt")
    return fix


def _example(r: _Render, ids: dict, t: _Template, source: Path, pad_id, grids, processor) -> Example:
    """Each trained turn as the model reads it when generating it: its prompt tokenized alone (as at inference),
    then what it generates tokenized as its own piece. Under ``all`` one sequence holds every turn, so each turn's
    sequence must also be how the next turn's prompt tokenizes."""
    c, prefix = r.conv, ids[r.p]
    seq: tuple[int, ...] = ()
    spans, previous = [], None
    for k, prompt, through in r.turns:
        read = ids[prompt]
        if read[: len(prefix)] != prefix:
            raise DataError(source, c.line, c.system_field, "the system turn's tokens are not a prefix of the "
                                                            "prompt's tokens (the tokenizer merges across the end of "
                                                            "the system turn)")
        if read[: len(seq)] != seq:
            raise DataError(source, c.line, c.message_field(previous), (
                "data.train_on: all needs one sequence that is what the model reads at every turn, but this turn "
                f"as generated is other tokens than in the prompt of {c.message_field(k)} tokenized whole (the "
                f"tokenizer merges across an edge of this turn); {_merge_fix(c, previous, t.kwargs)}"))
        generated = ids[through[len(prompt):]]
        if not generated:
            raise DataError(source, c.line, c.message_field(k), "the chat template renders nothing for this "
                                                              "assistant turn")
        spans.append((len(read), len(read) + len(generated)))
        seq, previous = read + generated, k
    whole_differs = seq != ids[r.whole]
    cont = list(seq[len(prefix):])
    spans = [(a - len(prefix), b - len(prefix)) for a, b in spans]
    images = c.images[: r.n_images]
    refs: tuple[ImageRef, ...] = ()
    if pad_id is not None and (images or pad_id in cont):
        for (a, b), (k, _, _) in zip(spans, r.turns):
            if pad_id in cont[a:b]:
                raise DataError(source, c.line, c.message_field(k), "an assistant turn holds an image placeholder")
        if cont.count(pad_id) != len(images):
            raise DataError(source, c.line, c.messages_field, f"{len(images)} images but {cont.count(pad_id)} image "
                                                        "placeholders after rendering the chat template")
        cont, where = _expand_images(cont, images, grids, pad_id, processor.merge_size)
        spans = [(where[a], where[b]) for a, b in spans]
        refs = tuple(ImageRef(path, grids[path]) for path, _ in images)
    first = spans[0][0]
    item, target = tuple(cont[:first]), tuple(cont[first:])
    explicit = tuple(spans) if spans != [(first, len(cont))] else ()
    return Example(r.id, prefix, item, target, str(source), c.line, refs, explicit, len(spans), whole_differs,
                   c.weight, c.pair, c.side, c.group, c.reward, c.logprobs, c.group_rewards)
