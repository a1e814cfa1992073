"""Loading examples: the three formats, the P / item / target split, and one clear error per kind of bad input."""

import json

import pytest

from packtrain.config import config_from_dict
from packtrain.data.jsonl import DataError, Example, detect_format, load_examples, load_split, load_tokenizer

RULEBOOK = "You are the clerk. Rule 1. Answer with the codes only.\n- falcon is written juru"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def concat_tok():
    """A tokenizer whose template joins the contents with nothing between them, so BPE merges across turns."""
    t = load_tokenizer()
    t.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return t


def write_lines(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def load_error(path, **kw) -> str:
    with pytest.raises(DataError) as e:
        load_examples(path, **kw)
    return str(e.value)


def text_record(**kw):
    return {"system": RULEBOOK, "item": "Encode: falcon", "target": "juru", **kw}


# --- the split into P, item and target -----------------------------------------------------------------------------

def test_text_example_is_split_at_the_turn_boundaries(tmp_path, tok):
    [ex] = load_examples(write_lines(tmp_path, [text_record(id="a")]), tokenizer=tok)
    assert tok.decode(ex.prefix_ids) == f"<|im_start|>system\n{RULEBOOK}<|im_end|>\n"
    # the generation prompt opens the think block (thinking is on unless data.template_kwargs turns it off)
    assert tok.decode(ex.item_ids) == "<|im_start|>user\nEncode: falcon<|im_end|>\n<|im_start|>assistant\n<think>\n"
    # the target: the (empty) reasoning's end, the answer and the end of the turn
    assert tok.decode(ex.target_ids) == "\n</think>\n\njuru<|im_end|>\n"
    assert ex.continuation_ids == ex.item_ids + ex.target_ids
    assert ex.len_continuation == len(ex.item_ids) + len(ex.target_ids)


def test_pieces_concatenate_to_the_whole_example_tokenized_alone(tmp_path, tok):
    [ex] = load_examples(write_lines(tmp_path, [text_record()]), tokenizer=tok)
    whole = (f"<|im_start|>system\n{RULEBOOK}<|im_end|>\n<|im_start|>user\nEncode: falcon<|im_end|>\n"
             "<|im_start|>assistant\n<think>\n\n</think>\n\njuru<|im_end|>\n")
    assert ex.prefix_ids + ex.item_ids + ex.target_ids == tuple(tok(whole, add_special_tokens=False)["input_ids"])


def test_text_and_chat_give_the_same_tokens(tmp_path, tok):
    chat = {"messages": [{"role": "system", "content": RULEBOOK}, {"role": "user", "content": "Encode: falcon"},
                         {"role": "assistant", "content": "juru"}]}
    [a] = load_examples(write_lines(tmp_path, [text_record()], "text.jsonl"), tokenizer=tok)
    [b] = load_examples(write_lines(tmp_path, [chat], "chat.jsonl"), tokenizer=tok)
    assert (a.prefix_ids, a.item_ids, a.target_ids) == (b.prefix_ids, b.item_ids, b.target_ids)


def test_chat_with_several_turns_puts_the_earlier_turns_in_the_item(tmp_path, tok):
    chat = {"id": "multi", "messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "juru"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "geno"},
    ]}
    [ex] = load_examples(write_lines(tmp_path, [chat]), tokenizer=tok)
    assert tok.decode(ex.prefix_ids) == "<|im_start|>system\nS<|im_end|>\n"
    assert tok.decode(ex.item_ids) == ("<|im_start|>user\none<|im_end|>\n<|im_start|>assistant\njuru<|im_end|>\n"
                                       "<|im_start|>user\ntwo<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert tok.decode(ex.target_ids) == "\n</think>\n\ngeno<|im_end|>\n"


def test_pretokenized_is_taken_as_is(tmp_path):
    path = write_lines(tmp_path, [{"id": "p", "prefix_ids": [5, 6, 7], "item_ids": [8], "target_ids": [9, 10]}])
    assert load_examples(path) == [Example("p", (5, 6, 7), (8,), (9, 10), str(path), 1)]


def test_id_defaults_to_the_line_number_counting_blank_lines(tmp_path):
    rec = {"prefix_ids": [1], "item_ids": [2], "target_ids": [3]}
    path = write_lines(tmp_path, [rec, "", {**rec, "id": 17}, rec])
    assert [(e.id, e.line) for e in load_examples(path)] == [("1", 1), ("17", 3), ("4", 4)]


def test_examples_with_the_same_system_share_one_prefix_tuple(tmp_path, tok):
    path = write_lines(tmp_path, [text_record(item="Encode: a"), text_record(item="Encode: b"),
                                  text_record(system="other")])
    a, b, c = load_examples(path, tokenizer=tok)
    assert a.prefix_ids is b.prefix_ids
    assert a.prefix_ids != c.prefix_ids


def test_empty_item_is_allowed(tmp_path, tok):
    [ex] = load_examples(write_lines(tmp_path, [text_record(item="")]), tokenizer=tok)
    assert tok.decode(ex.item_ids) == "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<think>\n"
    [ex] = load_examples(write_lines(tmp_path, [{"prefix_ids": [1], "item_ids": [], "target_ids": [2]}], "p.jsonl"))
    assert ex.item_ids == ()


@pytest.mark.parametrize("record, fmt", [
    (text_record(), "text"),
    ({"messages": []}, "chat"),
    ({"prefix_ids": [1], "item_ids": [], "target_ids": [2]}, "pretokenized"),
])
def test_detect_format(tmp_path, record, fmt):
    assert detect_format(write_lines(tmp_path, ["", record])) == fmt


def test_load_split_resolves_against_the_config_directory(tmp_path):
    (tmp_path / "d").mkdir()
    write_lines(tmp_path / "d", [{"prefix_ids": [1], "item_ids": [], "target_ids": [2]}], "train.jsonl")
    cfg = config_from_dict({"data": {"train": "d/train.jsonl"}}, base_dir=str(tmp_path))
    assert [e.target_ids for e in load_split(cfg, "train")] == [(2,)]
    assert load_split(cfg, "eval") is None


# --- bad input: each names the file, the line and the field ---------------------------------------------------------

def test_malformed_json(tmp_path):
    path = write_lines(tmp_path, [text_record(), '{"system": "s", "item": "i" "target": "t"}'])
    assert load_error(path).startswith(f"{path}:2: not valid JSON: Expecting ',' delimiter")


def test_invalid_utf8(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"system": "s", "item": "i", "target": "t"}\n{"system": "\xff", "item": "i", "target": "t"}\n')
    assert load_error(path) == f"{path}:2: not valid UTF-8"


def test_line_that_is_not_an_object(tmp_path):
    path = write_lines(tmp_path, ["[1, 2]"])
    assert load_error(path) == f"{path}:1: expected a JSON object, got list"


def test_missing_field(tmp_path):
    path = write_lines(tmp_path, [text_record(), {"system": "s", "item": "i"}])
    assert load_error(path) == f"{path}:2: field 'target': missing (the text format needs it)"


def test_mistyped_field(tmp_path):
    path = write_lines(tmp_path, [text_record(item=42)])
    assert load_error(path) == f"{path}:1: field 'item': expected a string, got 42"


def test_mistyped_token_ids(tmp_path):
    path = write_lines(tmp_path, [{"prefix_ids": [1, "2"], "item_ids": [], "target_ids": [3]}])
    assert load_error(path) == f"{path}:1: field 'prefix_ids': expected a list of integer token ids"
    path = write_lines(tmp_path, [{"prefix_ids": [1], "item_ids": [True], "target_ids": [3]}])
    assert load_error(path) == f"{path}:1: field 'item_ids': expected a list of integer token ids"


def test_negative_token_id(tmp_path):
    path = write_lines(tmp_path, [{"prefix_ids": [1], "item_ids": [], "target_ids": [3, -1]}])
    assert load_error(path) == f"{path}:1: field 'target_ids': token id -1 is negative"


def test_token_id_outside_the_vocabulary(tmp_path, tok):
    path = write_lines(tmp_path, [{"prefix_ids": [len(tok)], "item_ids": [], "target_ids": [3]}])
    assert load_error(path, tokenizer=tok) == (f"{path}:1: field 'prefix_ids': token id {len(tok)} is not below the "
                                               f"vocabulary size {len(tok)}")


@pytest.mark.parametrize("record, field", [
    (text_record(target=""), "target"),
    (text_record(target="  \n"), "target"),
    ({"prefix_ids": [1], "item_ids": [2], "target_ids": []}, "target_ids"),
])
def test_empty_target(tmp_path, record, field):
    path = write_lines(tmp_path, [record])
    assert load_error(path) == f"{path}:1: field '{field}': empty"


def test_empty_prefix(tmp_path):
    path = write_lines(tmp_path, [{"prefix_ids": [], "item_ids": [2], "target_ids": [3]}])
    assert load_error(path) == f"{path}:1: field 'prefix_ids': empty"


@pytest.mark.parametrize("lines", [[], ["", "   "]], ids=["no bytes", "blank lines"])
def test_empty_file(tmp_path, lines):
    path = write_lines(tmp_path, lines)
    assert load_error(path) == f"{path}: empty file: no examples"


def test_missing_file(tmp_path):
    assert load_error(tmp_path / "nope.jsonl") == f"{tmp_path / 'nope.jsonl'}: file not found"


def test_chat_without_a_system_message(tmp_path):
    path = write_lines(tmp_path, [{"messages": [{"role": "user", "content": "u"},
                                                {"role": "assistant", "content": "a"}]}])
    assert load_error(path) == f"{path}:1: field 'messages[0].role': the first message must be the system message, " \
                               "got user"


def test_chat_with_a_second_system_message(tmp_path):
    path = write_lines(tmp_path, [{"messages": [{"role": "system", "content": "s"}, {"role": "system", "content": "t"},
                                                {"role": "assistant", "content": "a"}]}])
    assert load_error(path) == f"{path}:1: field 'messages[1].role': only the first message may be a system message"


def test_chat_ending_with_a_user_message(tmp_path):
    path = write_lines(tmp_path, [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}])
    assert load_error(path) == f"{path}:1: field 'messages[1].role': the last message must be the assistant's " \
                               "(the target)"


def test_chat_with_an_unknown_role(tmp_path):
    path = write_lines(tmp_path, [{"messages": [{"role": "system", "content": "s"}, {"role": "critic", "content": "u"},
                                                {"role": "assistant", "content": "a"}]}])
    assert load_error(path) == f"{path}:1: field 'messages[1].role': expected one of system, user, assistant, tool, " \
                               'got "critic"'


def test_p_that_is_not_a_token_prefix_is_refused(tmp_path, concat_tok):
    # "jur" alone is several tokens; followed by "u" it becomes the single token "juru".
    path = write_lines(tmp_path, [text_record(system="jur", item="u", target="x")])
    message = load_error(path, tokenizer=concat_tok)
    assert message.startswith(f"{path}:1: field 'system': the system turn's tokens are not a prefix")


def test_a_target_that_merges_with_the_prompt_is_tokenized_as_generated(tmp_path, concat_tok):
    """The prompt tokenized alone (as at inference), the target as its own piece: "Rule.ju" + "ru" is not
    the tokens of "Rule.juru", and the example says so (plan counts it)."""
    path = write_lines(tmp_path, [text_record(system="Rule.", item="ju", target="ru"),
                                  text_record(system="Rule.", item="ju ", target="x")])
    merged, apart = load_examples(path, tokenizer=concat_tok)
    encode = concat_tok.encode
    assert merged.prefix_ids + merged.item_ids == tuple(encode("Rule.ju", add_special_tokens=False))
    assert merged.target_ids == tuple(encode("ru", add_special_tokens=False))
    assert merged.prefix_ids + merged.continuation_ids != tuple(encode("Rule.juru", add_special_tokens=False))
    assert (merged.whole_differs, apart.whole_differs) == (True, False)


def test_duplicate_id(tmp_path):
    rec = {"prefix_ids": [1], "item_ids": [], "target_ids": [2]}
    path = write_lines(tmp_path, [{**rec, "id": "x"}, rec, {**rec, "id": "x"}])
    assert load_error(path) == f"{path}:3: field 'id': 'x' is also the id of line 1"


def test_unrecognised_record(tmp_path):
    path = write_lines(tmp_path, [{"prompt": "p", "completion": "c"}])
    assert load_error(path).startswith(f"{path}:1: cannot tell the format from the keys ['completion', 'prompt']")


# --- every bad line at once: each as it is refused alone, in line order ---------------------------------------------

def test_every_bad_line_is_named_at_once_in_line_order(tmp_path):
    """Bad JSON, a bad field and a line over the byte limit: each line's first problem, as it reads alone."""
    rows = [text_record(id=str(i)) for i in range(6)]
    rows[1] = text_record(item=42)
    rows[3] = '{"system": "s", "item": "i" "target": "t"}'
    rows[4] = text_record(target="x" * 400)
    path = write_lines(tmp_path, rows)
    with pytest.raises(DataError) as e:
        load_examples(path, max_line_bytes=300)
    assert str(e.value) == "\n".join([
        f"{path}: 3 bad lines:",
        f"  - {path}:2: field 'item': expected a string, got 42",
        f"  - {path}:4: not valid JSON: Expecting ',' delimiter (column 29)",
        (f"  - {path}:5: line longer than 300 bytes: 32 bytes per token of packing.token_budget, more than any "
         "example that fits a pack (a missing newline joins lines)")])
    assert [(x.line, x.field) for x in e.value.errors] == [(2, "item"), (4, None), (5, None)]
    assert (e.value.line, e.value.field) == (2, "item")  # the first's, for a reader of one error


def test_past_twenty_bad_lines_the_rest_are_counted(tmp_path):
    path = write_lines(tmp_path, [text_record(target=i) for i in range(25)])
    lines = load_error(path).splitlines()
    assert lines[0] == f"{path}: 25 bad lines:"
    assert lines[1:21] == [f"  - {path}:{i + 1}: field 'target': expected a string, got {i}" for i in range(20)]
    assert lines[21:] == ["  ... and 5 more bad lines"]


def test_bad_lines_found_rendering_are_named_with_those_found_parsing(tmp_path, concat_tok):
    """A line the template renders badly (its P merges into the prompt), a line that does not parse, and a duplicate
    id: all three, in line order, and the good lines are not blamed."""
    path = write_lines(tmp_path, [text_record(id="a"), text_record(system="jur", item="u", target="x"),
                                  text_record(item=[]), text_record(id="a")])
    lines = load_error(path, tokenizer=concat_tok).splitlines()
    assert lines[0] == f"{path}: 3 bad lines:"
    assert lines[1].startswith(f"  - {path}:2: field 'system': the system turn's tokens are not a prefix")
    assert lines[2] == f"  - {path}:3: field 'item': expected a string, got []"
    assert lines[3] == f"  - {path}:4: field 'id': 'a' is also the id of line 1"


def test_a_format_is_found_past_bad_first_lines(tmp_path):
    rows = ["[1]", {"prefix_ids": [1], "item_ids": [], "target_ids": [2]}]
    assert detect_format(write_lines(tmp_path, rows)) == "pretokenized"
    path = write_lines(tmp_path, rows)
    assert load_error(path) == f"{path}:1: expected a JSON object, got list"
    path = write_lines(tmp_path, ["[1]", "{", {"prompt": "p"}])  # no line tells the format: each says why
    lines = load_error(path).splitlines()
    assert lines[0] == f"{path}: 3 bad lines:" and lines[3].startswith(f"  - {path}:3: cannot tell the format")
