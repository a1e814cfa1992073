"""What ``data.template_kwargs`` may hold: not apply_chat_template's own arguments (packtrain sets those per render),
Qwen's boolean switches as booleans, and a bounded size (a YAML alias bomb expands to billions of values)."""

from __future__ import annotations

# apply_chat_template's own arguments: packtrain sets them per render, data.template_kwargs may not; where each
# comes from instead
_RENDERS_TEXT = "packtrain renders text and tokenizes it itself"
TEMPLATE_ARGUMENTS = {
    "conversation": "the example's messages", "tools": "each example's `tools`",
    "documents": "no documents are rendered: put them in the messages",
    "chat_template": "data.chat_template", "add_generation_prompt": "packtrain adds it to each trained turn's prompt",
    "continue_final_message": "every turn is rendered whole", "tokenize": _RENDERS_TEXT, "padding": _RENDERS_TEXT,
    "truncation": "nothing is truncated: packing.token_budget bounds an example",
    "max_length": "nothing is truncated: packing.token_budget bounds an example", "return_tensors": _RENDERS_TEXT,
    "return_dict": _RENDERS_TEXT, "return_assistant_tokens_mask": "data.train_on picks the trained turns",
    "tokenizer_kwargs": _RENDERS_TEXT}
# Qwen's chat-template switches and the test their templates make of each: only a boolean passes `is false`, so
# enable_thinking "no" would leave thinking on
BOOLEAN_TEMPLATE_KWARGS = {"enable_thinking": "is false", "preserve_thinking": "is true"}


# data.template_kwargs is rendered into every example: bounded before anything walks it whole (a YAML alias bomb of
# a few lines is billions of values once expanded)
TEMPLATE_KWARGS_VALUES = 10_000
TEMPLATE_KWARGS_DEPTH = 16


def too_large(kwargs: dict) -> bool:
    """More than TEMPLATE_KWARGS_VALUES values or TEMPLATE_KWARGS_DEPTH levels; a value an alias repeats counts
    each time, and the count stops at the bound, so a bomb is never expanded."""
    values, stack = 0, [(kwargs, 1)]
    while stack:
        value, depth = stack.pop()
        values += 1
        if values > TEMPLATE_KWARGS_VALUES or depth > TEMPLATE_KWARGS_DEPTH:
            return True
        if isinstance(value, dict):
            stack += [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            stack += [(v, depth + 1) for v in value]
    return False


def template_kwargs_problems(kwargs: dict) -> list[str]:
    if too_large(kwargs):
        return [(f"data.template_kwargs: more than {TEMPLATE_KWARGS_VALUES} values or {TEMPLATE_KWARGS_DEPTH} levels "
                 "deep (YAML aliases count each time they are used); template switches are a few scalars")]
    problems = []
    reserved = sorted(set(kwargs) & set(TEMPLATE_ARGUMENTS))
    if reserved:
        where = "; ".join(f"{k}: {TEMPLATE_ARGUMENTS[k]}" for k in reserved)
        problems.append(f"data.template_kwargs: {', '.join(reserved)} {'is' if len(reserved) == 1 else 'are'} set by "
                        f"packtrain for each render ({where})")
    for key, test in BOOLEAN_TEMPLATE_KWARGS.items():
        if key in kwargs and not isinstance(kwargs[key], bool):
            problems.append(f"data.template_kwargs.{key}: expected true or false (unquoted), got {kwargs[key]!r}: "
                            f"Qwen's templates test `{key} {test}`, which no other value passes")
    return problems
