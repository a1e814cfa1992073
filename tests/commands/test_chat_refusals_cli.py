"""Chat data that a template, a template file or data.template_kwargs would silently change, refused through the
CLI (`packtrain plan`, in process) in one line naming the template, the file, the line and the field; and what
packtrain does with special tokens written inside message content (docs/design.md, "Chat data")."""

import pytest
from chat_data import CALC, CHATML, TOOLS, WEATHER, call, single, tool_loop, tutoring, write_jsonl
from cli_helpers import run_in_process, write_config

from packtrain.data.jsonl import load_examples, load_tokenizer

PACKING = {"token_budget": 2400, "max_continuations": 4}
# ChatML with the example's tools as one line of names before the system text: tools that differ only in their
# schemas render the same P
NAMES_ONLY = ("{%- if tools %}{{- '<|im_start|>system\\nTools: ' }}{%- for tool in tools %}{{- tool.function.name + "
              "' ' }}{%- endfor %}{{- '\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- "
              "'<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- for message in "
              "messages[1:] %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
              "'\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# ChatML that drops the system message
NO_SYSTEM = CHATML.replace("{%- for message in messages %}",
                           "{%- for message in messages if message['role'] != 'system' %}")
# ChatML that writes an assistant turn's reasoning only while it is the last message: once a later turn follows,
# the turn renders otherwise, while its generation prompt (and so its prompt) stays as it was
REASONING_LAST = CHATML.replace(
    "message['content'] + '<|im_end|>'",
    "(('<think>' + message['reasoning_content'] + '</think>') if loop.last and message['reasoning_content'] is "
    "defined else '') + message['content'] + '<|im_end|>'")


def _plan(tmp_path, rows, template=None, **data):
    """`packtrain plan` on ``rows`` (``template``: the text of data.chat_template): (exit code, stderr, the data
    file, the template file)."""
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    jinja = None
    if template is not None:
        jinja = tmp_path / "template.jinja"
        jinja.write_text(template)
        data["chat_template"] = str(jinja)
    cfg = write_config(tmp_path, data={"train": path, "eval": None, **data}, packing=PACKING)
    proc = run_in_process("plan", cfg, check=False)
    return proc.returncode, proc.stderr, path, jinja


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# --- a template must render the system text it was given --------------------------------------------------------

def test_a_template_that_drops_the_system_message_is_refused(tmp_path):
    code, err, path, jinja = _plan(tmp_path, [single(0), single(1)], NO_SYSTEM)
    assert code == 2
    for line in (1, 2):  # every bad line is named
        assert f"{path}:{line}: field 'messages[0]': the chat template {jinja} renders nothing before the first " \
            "user turn" in err


def test_a_template_that_renders_the_tools_but_not_the_system_text_is_refused(tmp_path):
    without_system = NAMES_ONLY.replace("'\\n' + messages[0]['content'] + '<|im_end|>\\n'", "'\\n<|im_end|>\\n'")
    code, err, path, jinja = _plan(tmp_path, [tool_loop(0)], without_system)
    assert code == 2
    assert f"{path}:1: field 'messages[0]': the chat template {jinja} does not render this system text" \
        in _one_line(err)


def test_different_tools_rendered_as_one_p_are_refused(tmp_path):
    other = {"type": "function", "function": {**CALC["function"], "description": "The difference of two integers."}}
    rows = [tool_loop(0), {**tool_loop(1), "tools": [WEATHER, other]}]
    code, err, path, jinja = _plan(tmp_path, rows, NAMES_ONLY)
    assert code == 2
    assert f"{path}:2: field 'tools': the chat template {jinja} renders this example's P as line 1's, whose tools " \
        "differ" in _one_line(err)
    assert _plan(tmp_path, [tool_loop(0), tool_loop(1)], NAMES_ONLY)[0] == 0  # the same tools share P


@pytest.mark.parametrize("text", ["", " \n"], ids=["empty", "blank"])
def test_an_empty_chat_template_file_is_refused(tmp_path, text):
    code, err, _, jinja = _plan(tmp_path, [single(0)], text)
    assert code == 2
    assert f"data.chat_template: {jinja} is empty" in _one_line(err)


def test_a_chat_template_file_that_is_not_utf8_is_named(tmp_path):
    # before: "'utf-8' codec can't decode byte 0xff in position 19", naming neither the file nor the key
    jinja = tmp_path / "latin1.jinja"
    jinja.write_bytes(CHATML.replace("{%- for message", "{#- caf\xe9 -#}{%- for message").encode("latin-1"))
    path = write_jsonl(tmp_path / "c.jsonl", [single(0)])
    cfg = write_config(tmp_path, data={"train": str(path), "eval": None, "chat_template": str(jinja)}, packing=PACKING)
    proc = run_in_process("plan", cfg, check=False)
    assert proc.returncode == 2
    offset = jinja.read_bytes().index(b"\xe9")
    assert _one_line(proc.stderr) == (f"packtrain plan: error: data.chat_template: {jinja} is not UTF-8 text (byte "
                                      f"0xe9 at offset {offset}): a Jinja template is text; save it as UTF-8")


def test_a_tokenizers_own_template_that_is_not_utf8_is_named(tmp_path):
    import shutil

    from packtrain.data.jsonl import BUNDLED_TOKENIZER

    tok = tmp_path / "tok"
    shutil.copytree(BUNDLED_TOKENIZER, tok)
    (tok / "chat_template.jinja").write_bytes(b"\xff" + (tok / "chat_template.jinja").read_bytes())
    code, err, _, _ = _plan(tmp_path, [single(0)], tokenizer=str(tok))
    assert code == 2
    assert _one_line(err) == (f"packtrain plan: error: tokenizer {tok}: chat_template.jinja is not UTF-8 text (byte "
                              "0xff at offset 0) (the tokenizer's chat template; data.chat_template replaces it): "
                              "save it as UTF-8")


def test_the_tools_check_names_the_template_in_use(tmp_path):
    code, err, path, jinja = _plan(tmp_path, [single(0), {**single(1), "tools": TOOLS}], CHATML)
    assert code == 2
    line = _one_line(err)
    assert f"{path}:2: field 'tools': the chat template {jinja} does not render tools" in line
    assert "tokenizer" not in line


# --- data.template_kwargs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("enable_thinking", "no"), ("preserve_thinking", "yes"),
                                       ("enable_thinking", 0)])
def test_thinking_switches_must_be_booleans(tmp_path, key, value):
    code, err, _, _ = _plan(tmp_path, [single(0)], template_kwargs={key: value})
    assert code == 2
    assert f"data.template_kwargs.{key}: expected true or false (unquoted), got {value!r}" in err


def test_each_reserved_template_argument_says_where_it_comes_from(tmp_path):
    code, err, _, _ = _plan(tmp_path, [single(0)], template_kwargs={"documents": [], "add_generation_prompt": True,
                                                                    "max_length": 10})
    assert code == 2
    assert ("data.template_kwargs: add_generation_prompt, documents, max_length are set by packtrain for each render "
            "(add_generation_prompt: packtrain adds it to each trained turn's prompt; documents: no documents are "
            "rendered: put them in the messages; max_length: nothing is truncated: packing.token_budget bounds an "
            "example)") in err
    assert "tools" not in err


# --- tool calls and rewritten history ---------------------------------------------------------------------------

def test_tool_call_arguments_that_are_not_json_are_refused(tmp_path):
    row = tool_loop(0)
    row["messages"][2]["tool_calls"] = [call("get_weather", '{"city": "Paris"')]
    code, err, path, _ = _plan(tmp_path, [single(0), row])
    assert code == 2
    assert f"{path}:2: field 'messages[2].tool_calls[0].function.arguments': not valid JSON text" in _one_line(err)


# Python's json takes NaN, Infinity, a number past a float (1e999) and a key given twice; JSON does not: each is
# refused naming the field. (A NaN inside tool-call arguments rendered as "NaN" into the training text.)
NOT_JSON = [
    ({"city": float("nan")}, "messages[2].tool_calls[0].function.arguments.city", "NaN is not a JSON number"),
    ({"city": "Paris", "days": {"n": "HUGE"}}, "messages[2].tool_calls[0].function.arguments.days.n",
     "1e999 is not a JSON number"),
    ('{"city": "Paris", "days": Infinity}', "messages[2].tool_calls[0].function.arguments.days",
     "Infinity is not a JSON number"),
    ('{"city": "Paris", "city": "Rome"}', "messages[2].tool_calls[0].function.arguments.city",
     "given twice in one object"),
]


@pytest.mark.parametrize("arguments, field, says", NOT_JSON, ids=["nan", "1e999", "infinity in text", "twice in text"])
def test_tool_call_arguments_that_json_does_not_allow_are_refused(tmp_path, arguments, field, says):
    import json

    row = tool_loop(0)
    row["messages"][2]["tool_calls"] = [call("get_weather", arguments)]
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(single(0)) + "\n" + json.dumps(row).replace('"HUGE"', "1e999") + "\n")
    cfg = write_config(tmp_path, data={"train": str(path), "eval": None}, packing=PACKING)
    proc = run_in_process("plan", cfg, check=False)
    assert proc.returncode == 2
    assert _one_line(proc.stderr).startswith(f"packtrain plan: error: {path}:2: field '{field}': {says}"), proc.stderr


def test_a_key_given_twice_in_a_message_names_the_message(tmp_path):
    import json

    path = tmp_path / "c.jsonl"
    line = json.dumps(single(0)).replace('"role": "assistant", ', '"role": "assistant", "content": "x", ', 1)
    path.write_text(line + "\n")
    cfg = write_config(tmp_path, data={"train": str(path), "eval": None}, packing=PACKING)
    proc = run_in_process("plan", cfg, check=False)
    assert proc.returncode == 2
    last = len(single(0)["messages"]) - 1
    assert _one_line(proc.stderr) == (f"packtrain plan: error: {path}:1: field 'messages[{last}].content': given twice "
                                      "in one object (JSON keeps the last silently)")


# a key packtrain does not read was dropped without a word: the template never saw it
UNKNOWN = [
    (lambda r: {"enable_thinking": False, **r}, "enable_thinking",
     "unknown key: a chat example has id, messages, tools, weight; template switches go in data.template_kwargs"),
    (lambda r: {**r, "messages": [*r["messages"][:-1], {**r["messages"][-1], "thinking": "hm"}]},
     "messages[LAST].thinking", ("unknown key: an assistant message has role, content, name, reasoning_content, "
                                 "tool_calls; a turn's reasoning goes in reasoning_content")),
    (lambda r: {**r, "messages": [{**r["messages"][0], "refusal": None}, *r["messages"][1:]]}, "messages[0].refusal",
     "unknown key: a system message has role, content, name"),
    (lambda r: {**r, "meta": {"source": "x"}}, "meta", "unknown key: a chat example has id, messages, tools, weight"),
]


@pytest.mark.parametrize("edit, field, says", UNKNOWN, ids=["enable_thinking", "thinking", "refusal", "meta"])
def test_an_unknown_key_on_an_example_or_a_message_is_refused(tmp_path, edit, field, says):
    row = edit(single(1))
    code, err, path, _ = _plan(tmp_path, [single(0), row])
    assert code == 2
    field = field.replace("LAST", str(len(row["messages"]) - 1))
    assert _one_line(err).startswith(f"packtrain plan: error: {path}:2: field '{field}': {says}"), err


@pytest.mark.parametrize("row, field, fmt", [
    ({"system": "s", "item": "i", "target": "t", "images_dir": "x"}, "images_dir",
     "a text example has id, system, item, target, images, weight"),
    ({"prefix_ids": [1], "item_ids": [2], "target_ids": [3], "score": 2}, "score",
     "a pretokenized example has id, prefix_ids, item_ids, target_ids, weight")], ids=["text", "pretokenized"])
def test_an_unknown_key_in_the_other_formats_is_refused(tmp_path, row, field, fmt):
    code, err, path, _ = _plan(tmp_path, [row])
    assert code == 2
    assert _one_line(err) == f"packtrain plan: error: {path}:1: field '{field}': unknown key: {fmt}", err


def test_all_on_a_template_that_rewrites_an_earlier_turn_names_that_turn(tmp_path):
    """The earlier turn's prompt is still a prefix of the whole conversation; the turn itself is not."""
    code, err, path, jinja = _plan(tmp_path, [single(0), tutoring(0, turns=3)], REASONING_LAST, train_on="all")
    assert code == 2
    assert f"{path}:2: field 'messages[2]': train_on: all cannot find assistant turn messages[2] in the whole " \
        f"conversation: the chat template {jinja} renders the conversation up to it differently" in _one_line(err)
    assert "rewrites history" in err and "data.train_on: each trains it" in err
    assert _plan(tmp_path, [single(0), tutoring(0, turns=3)], REASONING_LAST, train_on="each")[0] == 0


# --- special tokens written in message content -------------------------------------------------------------------

def test_special_tokens_in_content_are_read_as_the_tokens_they_name(tmp_path):
    """As a serving engine reads the same render: `<|im_end|>` typed in a message is the token, not its letters."""
    tok = load_tokenizer()
    row = single(0)
    row["messages"][1]["content"] = "Colour: red<|im_end|>\n<|im_start|>user\nColour: blue"
    [ex] = load_examples(write_jsonl(tmp_path / "c.jsonl", [row]), tokenizer=tok)
    ids = ex.continuation_ids
    im_end, im_start = tok.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    assert (ids.count(im_end), ids.count(im_start)) == (3, 3)  # the user's and the assistant's, and the typed one
