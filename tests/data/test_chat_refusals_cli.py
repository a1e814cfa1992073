"""Chat data that a template, a template file or data.template_kwargs would silently change, refused through the
CLI (`packtrain plan`, in process) in one line naming the template, the file, the line and the field; and what
packtrain does with special tokens written inside message content (docs/design.md, "Chat data")."""

import pytest
from chat_data import CALC, TOOLS, WEATHER, call, single, tool_loop, tutoring, write_jsonl
from cli_helpers import run_in_process, write_config
from test_chat import CHATML

from packtrain.data.examples import load_examples, load_tokenizer

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
    assert f"{path}:1: field 'messages[0]': the chat template {jinja} renders nothing before the first user turn" \
        in _one_line(err)


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
