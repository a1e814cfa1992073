"""Multi-turn chat data with reasoning, tools and tool responses, and an independent reference for which tokens carry
loss: the conversation rendered whole by the tokenizer's chat template, each trained assistant turn located in that
text from the turn's own fields as the Qwen3.6 format writes them, and the tokens inside those character spans
labelled (offsets from the fast tokenizer). Nothing here calls packtrain's splitting code.
"""

from __future__ import annotations

import json

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


def records(train_on: str, n: int = 2, reasoning: bool = True) -> list[dict]:
    """Conversations of every kind that ``train_on`` takes with the bundled template (``all``: those where no
    earlier turn is rewritten, i.e. every assistant turn after the last user message)."""
    out = [tool_loop(i, reasoning) for i in range(n)] + [single(i) for i in range(n)]
    if train_on != "all":
        out += [tutoring(i, reasoning=reasoning) for i in range(n)]
    return out


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


def reference_examples(tokenizer, record: dict, train_on: str, thinking: bool = True, turn_text=generated_text):
    """[(id, input ids, labels)] of one conversation: labels -100 outside the trained assistant spans."""
    messages, tools = record["messages"], record.get("tools")
    kwargs = {} if thinking else {"enable_thinking": False}
    assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "each":
        cuts = [(f"{record['id']}#{n}" if len(assistant) > 1 else record["id"], k + 1, [k])
                for n, k in enumerate(assistant, 1)]
    else:
        cuts = [(record["id"], len(messages), assistant if train_on == "all" else assistant[-1:])]
    out = []
    for name, upto, trained in cuts:
        text = tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=False, **kwargs)
        spans, cursor = [], 0
        for k in trained:
            head, gen = turn_text(messages[k], thinking)
            at = text.find(head + gen, cursor)
            assert at >= 0, f"turn {k} not found as the format writes it"
            spans.append((at + len(head), at + len(head) + len(gen)))
            cursor = spans[-1][1]
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        labels = [t if any(a <= s < b for a, b in spans) else -100 for t, (s, _) in zip(ids, enc["offset_mapping"])]
        labelled = "".join(tokenizer.decode([t]) for t in labels if t != -100)
        assert labelled == "".join(text[a:b] for a, b in spans), "a token straddles a span's edge"
        out.append((name, ids, labels))
    return out
