"""Chat data as people have it: every assistant turn (data.train_on last | all | each), reasoning, tools and tool
responses rendered by the bundled Qwen3.6-like template, and one clear error per kind of bad conversation.

Which tokens carry loss is checked against tests/chat_data.py's reference (the whole conversation rendered by the
template, each trained turn located in the text from its own fields, the tokens inside labelled), which shares no
code with packtrain's prefix renders.
"""

import json

import pytest
from chat_data import (
    AGENT,
    CHATML,
    TOOLS,
    assert_examples_are,
    chatml_generated_text,
    records,
    reference_examples,
    single,
    tool_loop,
    tutoring,
    write_jsonl,
)
from cli_helpers import REPO, run_in_process, write_config

from packtrain.data.jsonl import DataError, load_examples, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def chatml_tok():
    """A template that renders one line per message and nothing else: no tools, nothing rewritten."""
    t = load_tokenizer()
    t.chat_template = CHATML
    return t


def render(tok, messages, **kw):
    return tok.apply_chat_template(messages, tokenize=False, **kw)


# --- the bundled template behaves like Qwen3.6's ---------------------------------------------------------------------

def test_bundled_template_renders_the_qwen36_format(tok):
    conv = tool_loop(1)
    text = render(tok, conv["messages"], tools=TOOLS)
    # tools inside the system turn, after the system text
    system = text[: text.index("<|im_end|>\n") + len("<|im_end|>\n")]
    assert system.startswith(f"<|im_start|>system\n{AGENT}\n\n# Tools\n") and "<tools>\n" in system
    assert json.dumps(TOOLS[0]) in system and json.dumps(TOOLS[1]) in system
    # after the last user message: the think block, the tool call as JSON; the results in <tool_response> in a user
    # turn (two results in one turn)
    assert ("<|im_start|>assistant\n<think>\nI need the weather in Oslo.\n</think>\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n') in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n3\n</tool_response><|im_end|>" \
        in text
    assert text.count("<|im_start|>") == text.count("<|im_end|>") == 7  # <|im_end|> ends every turn
    assert text.endswith("<think>\nBoth known.\n</think>\n\nYes, 21 degrees; 1 plus 2 is 3.<|im_end|>\n")


def test_reasoning_before_the_last_user_message_is_dropped(tok):
    text = render(tok, tutoring(0, turns=2)["messages"])
    assert "red maps by the table." not in text  # the first answer's reasoning: before the last question
    assert "<|im_start|>assistant\nalpha<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nblue maps by the table.\n</think>\n\nbeta<|im_end|>\n")


def test_generation_prompt_opens_the_think_block_or_closes_an_empty_one(tok):
    messages = single(0)["messages"][:2]
    assert render(tok, messages, add_generation_prompt=True).endswith("<|im_start|>assistant\n<think>\n")
    assert render(tok, messages, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_vlm_tokenizer_has_the_same_template():
    text = (REPO / "packtrain/assets/tokenizer/chat_template.jinja").read_text()
    assert (REPO / "packtrain/assets/vlm/chat_template.jinja").read_text() == text


# --- which tokens carry loss: packtrain's examples == the reference labels --------------------------------------------

def _assert_matches_reference(examples, tok, rows, train_on, thinking=True, turn_text=None):
    kw = {"turn_text": turn_text} if turn_text else {}
    assert_examples_are(examples, [r for row in rows for r in reference_examples(tok, row, train_on, thinking, **kw)])


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("train_on", ["last", "all", "each"])
def test_loss_tokens_are_the_assistant_spans(tmp_path, tok, train_on, thinking):
    rows = records(train_on, reasoning=thinking)
    kw = {} if thinking else {"template_kwargs": {"enable_thinking": False}}
    examples = load_examples(write_jsonl(tmp_path / "c.jsonl", rows), tokenizer=tok, train_on=train_on, **kw)
    _assert_matches_reference(examples, tok, rows, train_on, thinking)
    turns = {"last": 1, "all": 3, "each": 1}[train_on]
    assert examples[0].turns == turns and (len(examples[0].spans) == turns or turns == 1)


def test_all_on_a_template_that_keeps_history_trains_every_turn(tmp_path, chatml_tok):
    rows = [tutoring(i, turns=3, reasoning=False) for i in range(2)]
    examples = load_examples(write_jsonl(tmp_path / "c.jsonl", rows), tokenizer=chatml_tok, train_on="all")
    _assert_matches_reference(examples, chatml_tok, rows, "all", turn_text=chatml_generated_text)
    assert [len(ex.spans) for ex in examples] == [3, 3]


def test_each_on_four_turns_gives_four_examples_that_share_p(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [tutoring(0, turns=4)])
    examples = load_examples(path, tokenizer=tok, train_on="each")
    assert [ex.id for ex in examples] == ["tutor0#1", "tutor0#2", "tutor0#3", "tutor0#4"]
    assert all(ex.prefix_ids is examples[0].prefix_ids for ex in examples)
    # each turn's history as when generating it: the reasoning of earlier answers is gone, its own is trained
    assert [tok.decode(ex.target_ids).split("\n</think>")[0] for ex in examples] == [
        "red maps by the table.", "blue maps by the table.", "green maps by the table.", "red blue maps by the table."]
    assert "maps by the table" not in tok.decode(examples[3].item_ids)


def test_plan_shows_conversations_turns_and_target_tokens(tmp_path, tok):
    data = write_jsonl(tmp_path / "c.jsonl", [tutoring(0, turns=4)])
    cfg = write_config(tmp_path, data={"train": data, "eval": None, "train_on": "each"},
                       packing={"token_budget": 2000, "max_continuations": 8})
    stats = json.loads(run_in_process("plan", cfg, "--json").stdout)
    examples = load_examples(data, tokenizer=tok, train_on="each")
    assert (stats["examples"], stats["conversations"], stats["turns"], stats["prompts"], stats["packs"]) == \
        (4, 1, 4, 1, 1)
    assert stats["target_tokens"] == sum(len(ex.target_ids) for ex in examples)
    table = run_in_process("plan", cfg).stdout
    assert (f"  data       1 conversation, 4 assistant turns trained, {stats['target_tokens']:,} target tokens"
            in table)


def test_all_on_a_template_that_rewrites_history_is_refused_naming_the_turn(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [single(0), tutoring(0, turns=2)])
    with pytest.raises(DataError) as e:
        load_examples(path, tokenizer=tok, train_on="all")
    assert (e.value.line, e.value.field) == (2, "messages[2]")
    assert "rewrites history" in str(e.value) and "data.train_on: each" in str(e.value)


# --- bad conversations: one clear error each, naming file, line and field ------------------------------------------

def _msgs(*messages):
    return {"messages": [{"role": "system", "content": "S"}, *messages]}


U = {"role": "user", "content": "u"}
A = {"role": "assistant", "content": "a"}


@pytest.mark.parametrize("record,field,message", [
    (_msgs(A), "messages[1].role", "roles out of order: an assistant message answers a user or tool message"),
    (_msgs(U, A, A), "messages[3].role", "roles out of order"),
    (_msgs(U, {"role": "tool", "content": "r"}, A), "messages[2].role",
     "a tool message must follow an assistant message with tool_calls"),
    (_msgs({"role": "user", "content": "u", "reasoning_content": "r"}, A), "messages[1].reasoning_content",
     "only an assistant message may carry reasoning_content"),
    (_msgs({"role": "user", "content": "u", "tool_calls": []}, A), "messages[1].tool_calls",
     "only an assistant message may carry tool_calls"),
    ({**_msgs(U, A), "tools": {"name": "x"}}, "tools", "expected a non-empty list of JSON function schemas"),
    ({**_msgs(U, A), "tools": ["get_weather"]}, "tools", "expected a non-empty list of JSON function schemas"),
    (_msgs(U, {"role": "assistant", "content": "  "}), "messages[2].content",
     "an assistant turn with nothing to train on"),
    (_msgs(U, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}),
     "messages[2].tool_calls[0]", "expected {\"type\": \"function\""),
    (_msgs(U, {"role": "assistant", "content": "a", "reasoning_content": 3}), "messages[2].reasoning_content",
     "expected a string"),
    (_msgs(U, A, U), "messages[3].role", "the last message must be the assistant's"),
    (_msgs(U, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
           {"role": "tool", "content": {"celsius": 20}}, A), "messages[3].content", "JSON-encode"),
])
def test_bad_conversations_name_file_line_and_field(tmp_path, tok, record, field, message):
    path = write_jsonl(tmp_path / "c.jsonl", [single(0), record])
    for train_on in ("last", "all", "each"):
        with pytest.raises(DataError) as e:
            load_examples(path, tokenizer=tok, train_on=train_on)
        assert (e.value.source, e.value.line, e.value.field) == (path, 2, field), str(e.value)
        assert message in str(e.value)


def test_a_template_that_cannot_render_tools_is_refused(tmp_path, chatml_tok):
    path = write_jsonl(tmp_path / "c.jsonl", [single(0), {**single(1), "tools": TOOLS}])
    with pytest.raises(DataError) as e:
        load_examples(path, tokenizer=chatml_tok)
    assert (e.value.line, e.value.field) == (2, "tools") and "does not render tools" in str(e.value)


def test_tools_belong_to_p_and_equal_tools_share_it(tmp_path, tok):
    rows = [tool_loop(0), tool_loop(1), {**tool_loop(2), "tools": TOOLS[:1]}, single(0)]
    a, b, c, d = load_examples(write_jsonl(tmp_path / "c.jsonl", rows), tokenizer=tok)
    assert a.prefix_ids is b.prefix_ids
    assert len({a.prefix_ids, c.prefix_ids, d.prefix_ids}) == 3
    assert tok.decode(a.prefix_ids) == render(tok, rows[0]["messages"][:1], tools=TOOLS)


def test_train_on_other_than_last_needs_text_or_chat(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prefix_ids": [1], "item_ids": [2], "target_ids": [3]}])
    with pytest.raises(ValueError, match="data.train_on: each picks assistant turns of text or chat data"):
        load_examples(path, train_on="each")


def test_template_kwargs_may_not_set_what_packtrain_sets(tmp_path):
    from packtrain.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"data.template_kwargs: add_generation_prompt, tools are set by packtrain"):
        config_from_dict({"data": {"template_kwargs": {"tools": [], "add_generation_prompt": True,
                                                       "enable_thinking": False}}})


def test_data_chat_template_replaces_the_tokenizers(tmp_path):
    from packtrain.config import config_from_dict
    from packtrain.data.jsonl import load_split

    (tmp_path / "chatml.jinja").write_text(CHATML)
    data = write_jsonl(tmp_path / "c.jsonl", [tutoring(0, turns=2, reasoning=False)])
    cfg = config_from_dict({"data": {"train": data, "chat_template": "chatml.jinja", "train_on": "all"}},
                           base_dir=str(tmp_path))
    [ex] = load_split(cfg, "train")
    assert [tok_decode(ex, a, b) for a, b in ex.loss_spans] == ["alpha<|im_end|>\n", "beta<|im_end|>\n"]
    cfg = config_from_dict({"data": {"train": data, "chat_template": "missing.jinja"}}, base_dir=str(tmp_path))
    with pytest.raises(ValueError, match="data.chat_template: no such file .*missing.jinja"):
        load_split(cfg, "train")


def tok_decode(ex, a, b):
    return load_tokenizer().decode(ex.continuation_ids[a:b])


# --- a message's name (OpenAI's chat format): rendered where the template writes it, refused where it would not ---

# ChatML writing a message's name after its role, as a template that uses names does
NAMED = CHATML.replace("message['role'] + '\\n'",
                       "message['role'] + (' ' + message['name'] if message['name'] is defined else '') + '\\n'")
# ChatML writing the users' names only
USER_NAMED = CHATML.replace("message['role'] + '\\n'", "message['role'] + (' ' + message['name'] if "
                            "message['role'] == 'user' and message['name'] is defined else '') + '\\n'")


def _named(**names):
    """single(0) with a name on the messages of the roles given (role=name)."""
    return {"id": "n", "messages": [{**m, **({"name": names[m["role"]]} if m["role"] in names else {})}
                                    for m in single(0)["messages"]]}


def test_a_message_name_reaches_the_template_that_writes_it(tmp_path):
    t = load_tokenizer()
    t.chat_template = NAMED
    [ex] = load_examples(write_jsonl(tmp_path / "c.jsonl", [_named(system="desk", user="alice")]), tokenizer=t)
    assert t.decode(ex.prefix_ids) == f"<|im_start|>system desk\n{single(0)['messages'][0]['content']}<|im_end|>\n"
    assert t.decode(ex.item_ids) == "<|im_start|>user alice\nColour: red<|im_end|>\n<|im_start|>assistant\n"
    # a system name is part of P: two names, two prompts
    rows = [_named(system="desk"), {**_named(system="door"), "id": "m"}]
    a, b = load_examples(write_jsonl(tmp_path / "two.jsonl", rows), tokenizer=t)
    assert a.prefix_ids != b.prefix_ids


@pytest.mark.parametrize("template, names, field", [
    (None, {"user": "alice"}, "messages[1].name"),  # the bundled template (Qwen's) writes no message's name
    (USER_NAMED, {"user": "alice", "system": "desk"}, "messages[0].name"),
])
def test_a_message_name_the_template_drops_is_refused(tmp_path, tok, template, names, field):
    t = tok
    if template is not None:
        t = load_tokenizer()
        t.chat_template = template
    path = write_jsonl(tmp_path / "c.jsonl", [single(1), _named(**names)])
    with pytest.raises(DataError) as e:
        load_examples(path, tokenizer=t)
    assert (e.value.line, e.value.field) == (2, field)
    assert "does not render a message's name: it would be dropped" in str(e.value)


def test_a_message_name_is_a_string(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [_named(user=3)])
    with pytest.raises(DataError) as e:
        load_examples(path, tokenizer=tok)
    assert (e.value.field, e.value.problem) == ("messages[1].name", "expected a string, got 3")


def test_a_trained_turns_name_in_its_header_is_refused(tmp_path):
    """A template that writes the assistant's name in the turn's header: the generation prompt has no name, so the
    model cannot be trained to write it; an earlier, untrained, turn may carry it."""
    t = load_tokenizer()
    t.chat_template = NAMED
    earlier = {"id": "e", "messages": [*_named(assistant="clerk")["messages"], {"role": "user", "content": "again"},
                                       {"role": "assistant", "content": "gamma"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [earlier, _named(assistant="clerk")])
    with pytest.raises(DataError) as e:
        load_examples(path, tokenizer=t)
    assert (e.value.line, e.value.field) == (2, "messages[2].name")
    assert "writes this assistant turn's name where its generation prompt has none" in str(e.value)
