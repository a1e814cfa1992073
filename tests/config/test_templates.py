"""What ``data.template_kwargs`` may hold (packtrain/config/templates.py): the size bound counted exactly at its edges
(values and depth), a value an alias repeats counted each time without expanding a bomb, apply_chat_template's own
arguments refused naming where each comes from, and Qwen's switches as booleans only."""

from packtrain.config.templates import (
    TEMPLATE_KWARGS_DEPTH,
    TEMPLATE_KWARGS_VALUES,
    template_kwargs_problems,
    too_large,
)


def _nested(levels: int) -> dict:
    """``levels`` dicts, each the only value of the one around it (the outermost is level 1)."""
    value: dict = {}
    for _ in range(levels - 1):
        value = {"k": value}
    return value


def test_the_bound_counts_every_value_and_level():
    # the mapping itself is one value: 9,999 keys make 10,000
    assert not too_large({f"k{i}": i for i in range(TEMPLATE_KWARGS_VALUES - 1)})
    assert too_large({f"k{i}": i for i in range(TEMPLATE_KWARGS_VALUES)})
    assert not too_large(_nested(TEMPLATE_KWARGS_DEPTH)) and too_large(_nested(TEMPLATE_KWARGS_DEPTH + 1))
    assert not too_large({"a": [[1, 2], {"b": 3}]})


def test_a_value_an_alias_repeats_counts_each_time_and_a_bomb_is_not_expanded():
    row = list(range(10))
    assert too_large({"a": [[row] * 10] * 100})  # 1 + 1 + 100 + 1,000 + 10,000 values from 3 lists
    assert not too_large({"a": [row] * 10})
    bomb = row
    for _ in range(9):  # 10**10 values once expanded
        bomb = [bomb] * 10
    assert too_large({"a": bomb})


def test_apply_chat_template_s_own_arguments_are_refused_naming_where_they_come_from():
    assert template_kwargs_problems({"tools": []}) == [
        "data.template_kwargs: tools is set by packtrain for each render (tools: each example's `tools`)"]
    [problem] = template_kwargs_problems({"tokenize": True, "chat_template": "x", "custom": 1})
    assert problem == ("data.template_kwargs: chat_template, tokenize are set by packtrain for each render "
                       "(chat_template: data.chat_template; tokenize: packtrain renders text and tokenizes it itself)")


def test_qwen_s_switches_take_booleans_only():
    assert template_kwargs_problems({"enable_thinking": False, "preserve_thinking": True}) == []
    assert template_kwargs_problems({"enable_thinking": "no", "preserve_thinking": 0}) == [
        ("data.template_kwargs.enable_thinking: expected true or false (unquoted), got 'no': Qwen's templates test "
         "`enable_thinking is false`, which no other value passes"),
        ("data.template_kwargs.preserve_thinking: expected true or false (unquoted), got 0: Qwen's templates test "
         "`preserve_thinking is true`, which no other value passes")]


def test_too_large_is_the_only_problem_reported():
    assert template_kwargs_problems({"tools": [0] * TEMPLATE_KWARGS_VALUES, "enable_thinking": "no"}) == [
        ("data.template_kwargs: more than 10000 values or 16 levels deep (YAML aliases count each time they are "
         "used); template switches are a few scalars")]
