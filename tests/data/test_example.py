"""One example (packtrain/data/example.py): its loss spans (the whole target unless spans are given) and the tokens
that carry loss, counted by hand; and the error naming a bad example's file, line and field."""

from packtrain.data.example import DataError, Example


def test_the_loss_spans_are_the_target_unless_given():
    plain = Example("a", (1, 2), (3, 4, 5), (6, 7))
    assert (plain.continuation_ids, plain.len_continuation) == ((3, 4, 5, 6, 7), 5)
    assert (plain.loss_spans, plain.n_targets) == (((3, 5),), 2)
    # two assistant turns of a chat: loss on [2, 4) and [6, 9) of the 9-token continuation, 5 tokens
    chat = Example("b", (1,), (2, 3), (4, 5, 6, 7, 8, 9, 10), spans=((2, 4), (6, 9)), turns=2)
    assert (chat.loss_spans, chat.n_targets) == (((2, 4), (6, 9)), 5)


def test_a_data_error_names_the_file_line_and_field():
    e = DataError("data/train.jsonl", 7, "messages[1].content", "expected a string")
    assert str(e) == "data/train.jsonl:7: field 'messages[1].content': expected a string"
    assert (e.source, e.line, e.field, e.problem) == ("data/train.jsonl", 7, "messages[1].content", "expected a string")
    assert str(DataError("data/train.jsonl", None, None, "empty file")) == "data/train.jsonl: empty file"
