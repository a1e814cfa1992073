"""Multi-turn chat data with reasoning, tools and tool responses, and an independent reference for which tokens carry
loss: the conversation rendered whole by the chat template (transformers), each trained assistant turn located in
that text from the turn's own fields as the format writes them (the bundled template's, or the official Qwen3.5 /
Qwen3.6 templates'), and the text cut there into pieces tokenized apart: the prompt before each trained turn as the
model reads it, and the turn's own text as it generates it. Nothing here calls packtrain's splitting code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QWEN_LIKE = REPO / "packtrain" / "assets" / "qwen_tokenizer"
# A plain ChatML template: no system default, no reasoning, no tools (the refusal tests derive broken ones from it).
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")


TEMPLATES_ENV = "PACKTRAIN_QWEN_TEMPLATES"  # a folder holding qwen3.5.jinja and qwen3.6.jinja
REQUIRE_TEMPLATES_ENV = "PACKTRAIN_REQUIRE_TEMPLATES"  # .ci/run sets it: a missing template fails, not skips


def official_template_path(version: str) -> Path:
    """Qwen's official chat template (``qwen3.5`` or ``qwen3.6``): in the folder $PACKTRAIN_QWEN_TEMPLATES names, else
    beside the checkout (``../shared/templates/``; from a git worktree, beside its main checkout). Never copied into
    the project. Where neither holds it the test skips, saying what to set (a clone of its own); under
    $PACKTRAIN_REQUIRE_TEMPLATES (CI) it fails instead."""
    places = [Path(os.environ[TEMPLATES_ENV])] if os.environ.get(TEMPLATES_ENV) else []
    places.append(REPO.parent / "shared" / "templates")
    git = REPO / ".git"
    if git.is_file():  # a worktree: .git names <main>/.git/worktrees/<name>
        main = Path(git.read_text().split("gitdir:", 1)[1].strip()).parents[2]
        places.append(main.parent / "shared" / "templates")
    for place in places:
        if (place / f"{version}.jinja").is_file():
            return place / f"{version}.jinja"
    message = (f"Qwen's official {version}.jinja not found in {' or '.join(map(str, places))}: set {TEMPLATES_ENV} "
               "to the folder holding qwen3.5.jinja and qwen3.6.jinja")
    if os.environ.get(REQUIRE_TEMPLATES_ENV):
        pytest.fail(message)
    pytest.skip(message)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALC = {"type": "function", "function": {
    "name": "add", "description": "The sum of two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = [WEATHER, CALC]
AGENT = "You are the travel clerk. Call a tool when you need a fact, then answer in one short line."
TUTOR = "You are the colour tutor. Red is alpha, blue is beta, green is gamma. Answer with the code."


def call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def tool_loop(i: int, reasoning: bool = True) -> dict:
    """One user query, then three assistant turns (all after the last user message): two tool calls (one with its
    arguments as JSON text, one turn calling two tools) and the answer."""
    city = ["Paris", "Oslo", "Lima", "Kyiv"][i % 4]
    r = (lambda text: {"reasoning_content": text}) if reasoning else (lambda text: {})
    return {"id": f"loop{i}", "tools": TOOLS, "messages": [
        {"role": "system", "content": AGENT},
        {"role": "user", "content": f"Is it warm in {city}, and what is {i} plus 2?"},
        {"role": "assistant", "content": "", **r(f"I need the weather in {city}."),
         "tool_calls": [call("get_weather", {"city": city})]},
        {"role": "tool", "content": json.dumps({"city": city, "celsius": 20 + i})},
        {"role": "assistant", "content": "Checking the sum too.", **r("Now the sum."),
         "tool_calls": [call("add", json.dumps({"a": i, "b": 2})), call("add", {"a": 2, "b": i})]},
        {"role": "tool", "content": str(i + 2)},
        {"role": "tool", "content": str(i + 2)},
        {"role": "assistant", "content": f"Yes, {20 + i} degrees; {i} plus 2 is {i + 2}.", **r("Both known.")},
    ]}


def tutoring(i: int, turns: int = 3, reasoning: bool = True) -> dict:
    """``turns`` user questions, each answered (reasoning on the answers when asked): the template drops the
    reasoning of every answer before the last question."""
    words = ["red", "blue", "green", "red blue"]
    codes = {"red": "alpha", "blue": "beta", "green": "gamma"}
    messages = [{"role": "system", "content": TUTOR}]
    for t in range(turns):
        w = words[(i + t) % len(words)]
        messages.append({"role": "user", "content": f"Colour: {w}"})
        answer = {"role": "assistant", "content": " ".join(codes[x] for x in w.split())}
        if reasoning:
            answer["reasoning_content"] = f"{w} maps by the table."
        messages.append(answer)
    return {"id": f"tutor{i}", "messages": messages}


def single(i: int) -> dict:
    return {"id": f"one{i}", "messages": [{"role": "system", "content": TUTOR},
                                          {"role": "user", "content": f"Colour: {['red', 'green'][i % 2]}"},
                                          {"role": "assistant", "content": ["alpha", "gamma"][i % 2]}]}


def typed_calls(i: int, reasoning: bool = True) -> dict:
    """One assistant turn calling a tool with arguments of every JSON type (the official templates write a string
    as it is and the rest as JSON, except Qwen3.5 a bare number or boolean as Python prints it), as JSON text."""
    args = {"city": "Oslo\nand Bergen", "days": i + 2, "metric": bool(i % 2), "ratio": 0.5, "tags": ["rain", "东京"],
            "where": {"lat": 59.9, "exact": None}}
    turn = {"role": "assistant", "content": "Let me look.", "tool_calls": [call("forecast", json.dumps(args))]}
    if reasoning:
        turn["reasoning_content"] = "\nA forecast needs every field.\n"
    return {"id": f"typed{i}", "tools": [{"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object", "properties": {k: {} for k in args}}}}], "messages": [
        {"role": "system", "content": AGENT}, {"role": "user", "content": "Forecast, please."}, turn]}


def cjk(i: int, reasoning: bool = True) -> dict:
    """CJK text everywhere, and the reasoning given inline as <think>...</think> in the content (the templates take
    it out of the content)."""
    answer = ["红色是阿尔法。", "蓝色是贝塔。"][i % 2]
    content = f"<think>\n颜色表：{answer}\n</think>\n\n{answer}" if reasoning else answer
    return {"id": f"cjk{i}", "messages": [{"role": "system", "content": "你是颜色老师。只用代码回答。"},
                                          {"role": "user", "content": f"颜色：{['红', '蓝'][i % 2]}"},
                                          {"role": "assistant", "content": content}]}


def records(train_on: str, n: int = 2, reasoning: bool = True) -> list[dict]:
    """Conversations of every kind that ``train_on`` takes with the bundled template (``all``: those where no
    earlier turn is rewritten, i.e. every assistant turn after the last user message)."""
    out = [tool_loop(i, reasoning) for i in range(n)] + [single(i) for i in range(n)]
    if train_on != "all":
        out += [tutoring(i, reasoning=reasoning) for i in range(n)]
    return out


def edge_cases() -> list[dict]:
    """Conversations at the edges of the official format: whitespace the templates trim, a call with no content and
    empty arguments, a flat call (no "function" wrapper) with nested arguments, user content as text parts, a tool
    loop after a second question with inline reasoning in CJK, an empty system message."""
    system = {"role": "system", "content": "  Be brief.\n"}
    tool = [{"type": "function", "function": {"name": "wx", "parameters": {}}}]
    return [
        {"id": "space", "messages": [system, {"role": "user", "content": "\n hi \n"},
                                     {"role": "assistant", "content": "\n\n hello \n", "reasoning_content": "  r  \n"}]},
        {"id": "bare", "tools": tool, "messages": [
            system, {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [call("wx", "{}")]},
            {"role": "tool", "content": "r1", "name": "wx"}, {"role": "tool", "content": "r2"},
            {"role": "assistant", "content": "done"}]},
        {"id": "flat", "tools": tool, "messages": [
            system, {"role": "user", "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": "x", "tool_calls": [{"name": "wx", "arguments": {"n": [1, {"a": False}]}}]},
            {"role": "tool", "content": "{}"}, {"role": "assistant", "content": "y"}]},
        {"id": "again", "tools": tool, "messages": [
            system, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "rb"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "", "tool_calls": [call("wx", {"city": "東京"})]},
            {"role": "tool", "content": "晴れ"}, {"role": "assistant", "content": "<think>\nok\n</think>\n\n晴れです"}]},
        {"id": "blank", "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "a"},
                                     {"role": "assistant", "content": "b"}]},
    ]


def official_records(train_on: str, n: int = 2, reasoning: bool = True) -> list[dict]:
    """:func:`records` and the conversations only the official templates' tests take."""
    return records(train_on, n, reasoning) + [f(i, reasoning) for f in (typed_calls, cjk) for i in range(n)]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# -- the reference ---------------------------------------------------------------------------------------------------
def generated_text(message: dict, thinking: bool) -> tuple[str, str]:
    """(what precedes the turn's generated text, the generated text) of an assistant turn after the last user
    message, as the Qwen3.6 format writes them: the think block (opened by the generation prompt when thinking is
    on, given whole and empty when it is off), the content, each tool call as JSON in <tool_call>, <|im_end|>."""
    content = message.get("content") or ""
    calls = ""
    for j, c in enumerate(message.get("tool_calls") or []):
        fn = c.get("function", c)
        args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"], ensure_ascii=False)
        calls += ("\n" if content or j else "") + '<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' \
            + args + "}\n</tool_call>"
    body = content.lstrip("\n") + calls + "<|im_end|>\n"
    reasoning = (message.get("reasoning_content") or "").strip("\n")
    if thinking:
        return "<|im_start|>assistant\n<think>\n", reasoning + "\n</think>\n\n" + body
    assert not reasoning, "thinking off: the generation prompt closes an empty think block"
    return "<|im_start|>assistant\n<think>\n\n</think>\n\n", body


def chatml_generated_text(message: dict, thinking: bool) -> tuple[str, str]:
    """The same for a plain ChatML template (one line per message, nothing rewritten)."""
    return "<|im_start|>assistant\n", message["content"] + "<|im_end|>\n"


def official_generated_text(version: str):
    """The turn text of the official Qwen3.5 (``qwen3.5``) or Qwen3.6 (``qwen3.6``) template, for a turn rendered with
    its think block (after the last user message, or any turn under Qwen3.6's preserve_thinking): content and
    reasoning trimmed, inline <think> taken out of the content, tool calls as XML with one parameter per argument."""
    def value(v) -> str:
        if isinstance(v, str):
            return v
        if version == "qwen3.5" and not isinstance(v, (dict, list)):
            return str(v)  # Jinja's `string` filter: Python's str (True, 0.5, None)
        return json.dumps(v, ensure_ascii=False)

    def turn_text(message: dict, thinking: bool) -> tuple[str, str]:
        content = (message.get("content") or "").strip()
        reasoning = message.get("reasoning_content")
        if reasoning is None and "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        reasoning = (reasoning or "").strip()
        calls = ""
        for j, c in enumerate(message.get("tool_calls") or []):
            fn = c.get("function", c)
            args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
            calls += ("\n\n" if content else "") if j == 0 else "\n"
            calls += f"<tool_call>\n<function={fn['name']}>\n"
            calls += "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in args.items())
            calls += "</function>\n</tool_call>"
        body = content + calls + "<|im_end|>\n"
        if thinking:
            return "<|im_start|>assistant\n<think>\n", reasoning + "\n</think>\n\n" + body
        assert not reasoning, "thinking off: the generation prompt closes an empty think block"
        return "<|im_start|>assistant\n<think>\n\n</think>\n\n", body

    return turn_text


def as_objects(messages: list[dict]) -> list[dict]:
    """Tool-call arguments given as JSON text, parsed: what they mean (the official templates need objects)."""
    def parsed(fn: dict) -> dict:
        a = fn.get("arguments", {})
        return {**fn, "arguments": json.loads(a) if isinstance(a, str) else a}

    return [{**m, "tool_calls": [{**c, "function": parsed(c["function"])} if "function" in c else parsed(c)
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


class NotOneSequence(AssertionError):
    """Under ``all``, the trained turns cannot be one sequence that is what the model reads at every turn."""


def reference_examples(tokenizer, record: dict, train_on: str, thinking: bool = True, turn_text=generated_text,
                       chat_template: str | None = None, **template_kwargs):
    """[(id, input ids, labels)] of one conversation: labels -100 outside the trained assistant spans.

    The text is cut at each trained turn's edges and each piece tokenized alone: the prompt before a turn is what
    the model reads, the turn what it generates. Under ``all`` the pieces before turn k must also be the prompt of
    turn k tokenized whole (:class:`NotOneSequence` when not).
    """
    messages, tools = as_objects(record["messages"]), record.get("tools")
    kwargs = {**template_kwargs, **({} if thinking else {"enable_thinking": False}),
              **({"chat_template": chat_template} if chat_template else {})}
    assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "each":
        cuts = [(f"{record['id']}#{n}" if len(assistant) > 1 else record["id"], k + 1, [k])
                for n, k in enumerate(assistant, 1)]
    else:
        cuts = [(record["id"], len(messages), assistant if train_on == "all" else assistant[-1:])]
    out = []
    for name, upto, trained in cuts:
        text = tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=False, **kwargs)
        ids, labels, cursor = [], [], 0
        for k in trained:
            head, gen = turn_text(messages[k], thinking)
            at = text.find(head + gen, cursor)
            assert at >= 0, f"turn {k} not found as the format writes it"
            a, b = at + len(head), at + len(head) + len(gen)
            before = tokenizer(text[cursor:a], add_special_tokens=False)["input_ids"]
            ids += before
            labels += [-100] * len(before)
            if ids != tokenizer(text[:a], add_special_tokens=False)["input_ids"]:
                raise NotOneSequence(f"{name}: turn {k}")
            own = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
            ids += own
            labels += own
            cursor = b
        assert cursor == len(text), "the last trained turn ends the text"
        out.append((name, ids, labels))
    return out


def assert_examples_are(examples, reference) -> None:
    """packtrain's examples carry exactly the reference's ids and loss tokens, in order."""
    assert [ex.id for ex in examples] == [name for name, _, _ in reference]
    for ex, (name, ids, labels) in zip(examples, reference):
        assert list(ex.prefix_ids + ex.continuation_ids) == ids, name
        p = len(ex.prefix_ids)
        ours = [-100] * len(ids)
        for a, b in ex.loss_spans:
            ours[p + a: p + b] = ids[p + a: p + b]
        assert ours == labels, name
        assert ex.n_targets == sum(t != -100 for t in labels)
        assert ex.item_ids and labels[p + len(ex.item_ids)] != -100  # the target starts with a loss token
