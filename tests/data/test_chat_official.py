"""Chat data under Qwen's official Qwen3.5 and Qwen3.6 chat templates (read from ../shared/templates/, never copied),
with the bundled tokenizer and the Qwen-like one (packtrain/assets/qwen_tokenizer: Qwen's split rule, "\\n\\n" one
token, <think> and <tool_call> added tokens): P found although the templates refuse a system message alone, the
loss tokens equal tests/chat_data.py's reference (transformers renders the template; each trained turn located from
its own fields as the official format writes it; prompt and turn tokenized apart), and refusals only where no exact
split exists, each naming its fix.
"""

import json

import pytest
from chat_data import (
    AGENT,
    QWEN_LIKE,
    TOOLS,
    NotOneSequence,
    assert_examples_are,
    cjk,
    edge_cases,
    official_generated_text,
    official_records,
    official_template_path,
    reference_examples,
    single,
    tool_loop,
    typed_calls,
    write_jsonl,
)
from cli_helpers import run_in_process, write_config

from packtrain.data.jsonl import DataError, load_examples, load_tokenizer

VERSIONS = ["qwen3.5", "qwen3.6"]


@pytest.fixture(scope="module")
def toks():
    return {"bundled": load_tokenizer(), "qwen-like": load_tokenizer(QWEN_LIKE)}


@pytest.fixture(scope="module")
def templates():
    """Each official template's text and file (data.chat_template names the file)."""
    return {v: (official_template_path(v).read_text(), official_template_path(v)) for v in VERSIONS}


def _load(tmp_path, rows, tok, template, train_on, thinking=True, **kwargs):
    kwargs = {**kwargs, **({} if thinking else {"enable_thinking": False})}
    return load_examples(write_jsonl(tmp_path / "c.jsonl", rows), tokenizer=tok, train_on=train_on,
                         chat_template=template, template_kwargs=kwargs)


def _assert_matches_reference(examples, tok, rows, train_on, version, text, thinking=True, **kwargs):
    assert_examples_are(examples, [r for row in rows for r in reference_examples(
        tok, row, train_on, thinking, official_generated_text(version), text, **kwargs)])


def test_the_templates_folder_is_named_by_its_variable_and_a_missing_one_skips_or_fails(tmp_path, monkeypatch):
    """A clone of its own (no ../shared) skips the official templates' tests saying what to set; CI, which requires
    them (.ci/run), fails instead."""
    import chat_data

    (tmp_path / "qwen3.5.jinja").write_text("{{ messages }}")
    monkeypatch.setenv(chat_data.TEMPLATES_ENV, str(tmp_path))
    assert official_template_path("qwen3.5") == tmp_path / "qwen3.5.jinja"
    monkeypatch.setattr(chat_data, "REPO", tmp_path / "clone")  # nothing beside it
    monkeypatch.delenv(chat_data.REQUIRE_TEMPLATES_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="set PACKTRAIN_QWEN_TEMPLATES to the folder"):
        official_template_path("qwen3.6")
    monkeypatch.setenv(chat_data.REQUIRE_TEMPLATES_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="qwen3.6.jinja not found"):
        official_template_path("qwen3.6")


# --- what the official templates do that packtrain must meet -------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_the_official_templates_refuse_a_system_message_alone(toks, templates, version):
    from jinja2 import TemplateError

    with pytest.raises(TemplateError, match="No user query found in messages"):
        toks["bundled"].apply_chat_template([{"role": "system", "content": AGENT}], tokenize=False,
                                            chat_template=templates[version][0])


def test_the_qwen_like_tokenizer_merges_as_qwens(toks):
    tok = toks["qwen-like"]
    encode = lambda text: tok.encode(text, add_special_tokens=False)
    assert len(encode("\n\n")) == 1
    assert encode("<think>\n") + encode("\n</think>") != encode("<think>\n\n</think>")
    added = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
             "<tool_response>", "</tool_response>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    assert [len(encode(t)) for t in added] == [1] * len(added)
    assert encode("12") == encode("1") + encode("2")  # single digits
    assert len(tok) <= 1024  # the tiny test models' embedding rows


# --- the loss tokens equal the reference ---------------------------------------------------------------------------

@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("train_on", ["last", "all", "each"])
@pytest.mark.parametrize("tokenizer", ["bundled", "qwen-like"])
@pytest.mark.parametrize("version", VERSIONS)
def test_loss_tokens_equal_the_reference(tmp_path, toks, templates, version, tokenizer, train_on, thinking):
    """Reasoning (a field and inline <think>), tools with parallel calls, string and object arguments of every
    JSON type, tool responses, CJK text."""
    tok, (text, path) = toks[tokenizer], templates[version]
    rows = official_records(train_on, reasoning=thinking)
    examples = _load(tmp_path, rows, tok, path, train_on, thinking)
    _assert_matches_reference(examples, tok, rows, train_on, version, text, thinking)
    by_id = {ex.id: ex for ex in examples}
    loop = by_id["loop0"] if train_on != "each" else by_id["loop0#3"]
    assert tok.decode(loop.prefix_ids).endswith(f"{AGENT}<|im_end|>\n")  # the system block, tools first in it


@pytest.mark.parametrize("version", VERSIONS)
def test_edge_cases_equal_the_reference(tmp_path, toks, templates, version):
    text, path = templates[version]
    rows = edge_cases()
    for train_on in ("last", "each"):
        examples = _load(tmp_path, rows, toks["qwen-like"], path, train_on)
        _assert_matches_reference(examples, toks["qwen-like"], rows, train_on, version, text)


@pytest.mark.parametrize("train_on", ["last", "all", "each"])
def test_preserve_thinking_keeps_every_turn_so_all_trains_multi_turn_chat(tmp_path, toks, templates, train_on):
    text, path = templates["qwen3.6"]
    tok = toks["qwen-like"]
    rows = official_records("each")  # multi-turn chat included
    examples = _load(tmp_path, rows, tok, path, train_on, preserve_thinking=True)
    _assert_matches_reference(examples, tok, rows, train_on, "qwen3.6", text, preserve_thinking=True)
    if train_on == "all":
        assert {ex.id: ex.turns for ex in examples}["tutor0"] == 3
        # without preserve_thinking the first answers lose their reasoning once the next question follows
        with pytest.raises(DataError, match="rewrites history.*data.train_on: each trains it"):
            _load(tmp_path, rows, tok, path, "all")


def test_p_is_the_system_block_and_equal_system_and_tools_share_it(tmp_path, toks, templates):
    text, path = templates["qwen3.6"]
    tok = toks["qwen-like"]
    rows = [tool_loop(0), tool_loop(1), typed_calls(0), single(0), single(1), {**tool_loop(2), "tools": TOOLS[:1]}]
    a, b, typed, s0, s1, one_tool = _load(tmp_path, rows, tok, path, "last")
    assert a.prefix_ids is b.prefix_ids and s0.prefix_ids is s1.prefix_ids
    assert len({a.prefix_ids, typed.prefix_ids, s0.prefix_ids, one_tool.prefix_ids}) == 4
    whole = tok.apply_chat_template(rows[0]["messages"][:2], tools=TOOLS, tokenize=False, chat_template=text)
    system = whole[: whole.index("<|im_end|>\n") + len("<|im_end|>\n")]
    assert tok.decode(a.prefix_ids) == system and system.startswith("<|im_start|>system\n# Tools")
    assert tok.decode(s0.prefix_ids) == f"<|im_start|>system\n{single(0)['messages'][0]['content']}<|im_end|>\n"


# --- the split tokenization: as the model reads and generates -------------------------------------------------------

def test_a_turn_without_reasoning_is_tokenized_as_generated(tmp_path, toks, templates):
    """Thinking on: the prompt ends <think>\\n, the turn starts \\n</think>; Qwen's tokenizer merges the two newlines
    when the render is tokenized whole. The example is the prompt as the model reads it and the turn as it
    generates it, and plan counts it."""
    path = templates["qwen3.6"][1]
    tok = toks["qwen-like"]
    rows = [single(0), tool_loop(0)]
    one, loop = _load(tmp_path, rows, tok, path, "last")
    assert tok.convert_ids_to_tokens(list(one.item_ids[-2:])) == ["<think>", "Ċ"]
    assert tok.decode(one.target_ids) == "\n</think>\n\nalpha<|im_end|>\n"
    assert (one.whole_differs, loop.whole_differs) == (True, False)
    data = write_jsonl(tmp_path / "c.jsonl", rows)
    cfg = write_config(tmp_path, data={"train": data, "eval": None, "chat_template": str(path),
                                       "tokenizer": str(QWEN_LIKE)}, packing={"token_budget": 2400})
    assert json.loads(run_in_process("plan", cfg, "--json").stdout)["whole_differs"] == 1
    assert ("  tokens     1 example tokenized as generated (prompt, then target) differs from the whole render "
            "tokenized at once") in run_in_process("plan", cfg).stdout


def test_all_refuses_a_turn_the_next_prompt_tokenizes_otherwise(tmp_path, toks, templates):
    """Thinking on, tool calls without reasoning: each call turn's own tokens end ...\\n</think>\\n\\n as generated,
    but the next turn's prompt, tokenized whole, merges <think>\\n\\n</think>: one sequence cannot be both. The
    reference agrees that it is impossible; each and enable_thinking: false train it."""
    text, path = templates["qwen3.6"]
    tok = toks["qwen-like"]
    rows = [single(0), tool_loop(0, reasoning=False)]
    with pytest.raises(NotOneSequence):
        reference_examples(tok, rows[1], "all", True, official_generated_text("qwen3.6"), text)
    with pytest.raises(DataError) as e:
        _load(tmp_path, rows, tok, path, "all")
    assert (e.value.line, e.value.field) == (2, "messages[2]")
    assert "data.train_on: each trains it" in str(e.value) and "enable_thinking: false" in str(e.value)
    for train_on, thinking in (("each", True), ("all", False)):
        examples = _load(tmp_path, rows, tok, path, train_on, thinking)
        _assert_matches_reference(examples, tok, rows, train_on, "qwen3.6", text, thinking)
    # the bundled tokenizer has no such merge: one sequence is what the model reads at every turn
    examples = _load(tmp_path, rows, toks["bundled"], path, "all")
    _assert_matches_reference(examples, toks["bundled"], rows, "all", "qwen3.6", text)


# --- refusals that name the cause ----------------------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_thinking_off_with_reasoning_names_the_turn_and_the_conflict(tmp_path, toks, templates, version):
    path = templates[version][1]
    cases = [(tool_loop(0), "last", "messages[7].reasoning_content"), (tool_loop(0), "all", "messages[2].reasoning_content"),
             (tool_loop(0), "each", "messages[2].reasoning_content"), (cjk(0), "last", "messages[2].content")]
    for row, train_on, field in cases:
        with pytest.raises(DataError) as e:
            _load(tmp_path, [single(0), row], toks["qwen-like"], path, train_on, thinking=False)
        assert (e.value.line, e.value.field) == (2, field), str(e.value)
        assert "carries reasoning, but data.template_kwargs sets enable_thinking: false" in str(e.value)


def test_a_template_that_raises_names_itself_the_message_and_its_text(tmp_path, toks, templates):
    """A user turn that looks like a tool response is no user query to Qwen's templates."""
    path = templates["qwen3.6"][1]
    row = {"messages": [{"role": "system", "content": AGENT},
                        {"role": "user", "content": "<tool_response>\n3\n</tool_response>"},
                        {"role": "assistant", "content": "three"}]}
    with pytest.raises(DataError) as e:
        _load(tmp_path, [single(0), row], toks["qwen-like"], path, "last")
    assert (e.value.line, e.value.field) == (2, "messages[1]")
    assert f"the chat template {path} raised on messages[1]: No user query found in messages." in str(e.value)


def test_tool_call_arguments_that_are_not_json_are_refused(tmp_path, toks, templates):
    bad = tool_loop(0)
    bad["messages"][4]["tool_calls"][1]["function"]["arguments"] = '{"a": 2, "b": }'
    listed = tool_loop(1)
    listed["messages"][4]["tool_calls"][0]["function"]["arguments"] = "[2, 1]"
    for row, problem in ((bad, "not valid JSON text: Expecting value (column 15)"), (listed, "expected a JSON object")):
        with pytest.raises(DataError) as e:
            _load(tmp_path, [single(0), row], toks["qwen-like"], templates["qwen3.5"][1], "last")
        j = 1 if row is bad else 0
        assert (e.value.line, e.value.field) == (2, f"messages[4].tool_calls[{j}].function.arguments")
        assert problem in str(e.value)
