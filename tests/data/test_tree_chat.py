"""Chat data under ``data.train_on: each`` in a prefix tree (``packing.mode: tree``), with Qwen's official Qwen3.5
and Qwen3.6 templates and the bundled and Qwen-like tokenizers: what the tree shares, derived from the rendered
text alone (transformers renders the template; tests/chat_data.py's reference tokenizes each example's prompt and
turn apart), never from packtrain's splitting.

- A template that drops reasoning before the last user message: the history without reasoning is an interior node
  that the later turns run through, and each turn with its reasoning is a leaf of its own.
- A render that keeps history (the turns of a tool loop, all after the last user message; Qwen3.6's
  ``preserve_thinking``): turn k's path is a prefix of turn k+1's, so its target lies on an interior node, and the
  tree is as long as the longest path plus the other conversations' unshared tokens.
- A history renders the same but tokenizes otherwise (thinking on, a turn without reasoning, Qwen's ``\\n\\n``
  token): the turn as generated and the next prompt are other tokens, and the tree parts exactly there.
- Through the CLI: a tree run on such data trains the update and the per-example losses of standalone examples,
  and its plan computes the independently counted positions, fewer than shared_prefix's.
"""

import json
import os

import pytest
from chat_data import (
    QWEN_LIKE,
    as_objects,
    assert_examples_are,
    official_generated_text,
    official_template_path,
    reference_examples,
    tool_loop,
    tutoring,
    write_jsonl,
)
from cli_helpers import SGD, assert_tree_trains_as_standalone, run_in_process, write_config

from packtrain.data.jsonl import load_examples, load_tokenizer
from packtrain.data.planner import plan_tree_packs
from packtrain.data.prefix_tree import example_tree

VERSIONS = ["qwen3.5", "qwen3.6"]
TOKENIZERS = ["bundled", "qwen-like"]


@pytest.fixture(scope="module")
def toks():
    return {"bundled": load_tokenizer(), "qwen-like": load_tokenizer(QWEN_LIKE)}


def _each(tmp_path, rows, tok, version, **kwargs):
    """packtrain's examples of ``rows`` under train_on: each, and the reference's [(id, ids, labels)]; asserted
    equal, so the tree below is built over the reference's tokens."""
    examples = load_examples(write_jsonl(tmp_path / "c.jsonl", rows), tokenizer=tok, train_on="each",
                             chat_template=official_template_path(version), template_kwargs=kwargs)
    text = official_template_path(version).read_text()
    thinking = kwargs.get("enable_thinking", True)
    reference = [r for row in rows for r in reference_examples(tok, row, "each", thinking,
                                                                official_generated_text(version), text, **kwargs)]
    assert_examples_are(examples, reference)
    return examples, [ids for _, ids, _ in reference]


def _renders(tok, row, version, **kwargs):
    """Per assistant turn of ``row``: (its prompt, the text through it as generated), as transformers renders the
    template: the conversation before the turn with the generation prompt, and the conversation cut after it."""
    messages, text = as_objects(row["messages"]), official_template_path(version).read_text()

    def render(upto, prompt=False):
        return tok.apply_chat_template(messages[:upto], tools=row.get("tools"), tokenize=False,
                                       add_generation_prompt=prompt, chat_template=text, **kwargs)

    return [(render(k, True), render(k + 1)) for k, m in enumerate(messages) if m["role"] == "assistant"]


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def distinct_prefixes(sequences) -> int:
    """The tokens of a token trie over ``sequences``: each distinct non-empty prefix once."""
    return len({tuple(s[:j]) for s in sequences for j in range(1, len(s) + 1)})


def _tree(examples):
    """The tree of one prompt group, and the plan's one pack of it agreeing with it (a budget that holds all)."""
    tree = example_tree(examples)
    p = len(examples[0].prefix_ids)
    plan = plan_tree_packs(examples, p + tree.positions, len(examples))
    assert [pack.positions for pack in plan.packs] == [p + tree.positions]
    return tree


def _is_prefix(a, b) -> bool:
    return list(b[: len(a)]) == list(a)


# --- reasoning dropped before the last user message -----------------------------------------------------------------

@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@pytest.mark.parametrize("version", VERSIONS)
def test_the_history_without_reasoning_is_shared_and_each_turn_with_its_reasoning_is_a_leaf(tmp_path, toks,
                                                                                             version, tokenizer):
    tok, turns = toks[tokenizer], 4
    rows = [tutoring(i, turns) for i in range(3)]  # first questions red, blue, green: conversations part there
    examples, ids = _each(tmp_path, rows, tok, version)
    tree = _tree(examples)
    p = len(examples[0].prefix_ids)
    assert tree.positions == distinct_prefixes(ids) - p < sum(len(s) - p for s in ids)
    leaves = [chain[-1] for chain in tree.paths]
    assert len(set(leaves)) == len(examples) and all(not tree.nodes[n].children for n in leaves)
    for c, row in enumerate(rows):
        renders = _renders(tok, row, version)
        first = c * turns  # the example of the conversation's first turn
        for t in range(turns - 1):
            j = first + t
            (_, through), (next_prompt, _) = renders[t], renders[t + 1]
            # the text turn t as generated and turn t + 1's prompt agree on: the history, turn t's prompt header; turn
            # t goes on with its reasoning, turn t + 1 with turn t's answer without it
            common = os.path.commonprefix([through, next_prompt])
            assert common.endswith("<|im_start|>assistant\n") and "<think>" not in common
            reasoning = row["messages"][2 * t + 2]["reasoning_content"]
            assert through[len(common):].startswith(f"<think>\n{reasoning}") and reasoning not in next_prompt
            history = _ids(tok, common)  # the same tokens in both examples, and they part right after it
            assert _is_prefix(history, ids[j]) and _is_prefix(history, ids[j + 1])
            assert ids[j][len(history)] != ids[j + 1][len(history)]
            shared = len(history) - p
            node = tree.node_at(j, shared - 1)
            assert tree.nodes[node].end == shared and tree.nodes[node].children  # interior, ending there
            assert [k for k in range(len(examples)) if node in tree.paths[k]] == list(range(j, first + turns))
            # the rest of turn t's path is one leaf: the turn with its reasoning, its whole target
            leaf = tree.nodes[tree.paths[j][-1]]
            assert leaf.start == shared and leaf.start <= len(examples[j].item_ids)
            assert tok.decode(leaf.tokens) == through[len(common):]
            assert list(leaf.tokens) == ids[j][p + shared:]
        # the last turn's leaf: from where it parts from the turn before (that turn's answer, the last question, the
        # last turn with its reasoning)
        last = tree.nodes[tree.paths[first + turns - 1][-1]]
        assert last.start == shared and list(last.tokens) == ids[first + turns - 1][p + shared:]


# --- history kept: turn k's target inside turn k+1's history --------------------------------------------------------

HISTORY_KEPT = [  # (version, template kwargs, conversations) that render every turn as it was generated
    ("qwen3.5", {}, [tool_loop(0), tool_loop(1)]),  # every turn after the last user message
    ("qwen3.6", {}, [tool_loop(0), tool_loop(1)]),
    ("qwen3.6", {"preserve_thinking": True}, [tutoring(0, 4), tutoring(1, 4)]),
    ("qwen3.6", {"preserve_thinking": True, "enable_thinking": False},
     [tutoring(0, 4, reasoning=False), tutoring(1, 4, reasoning=False)]),
]


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@pytest.mark.parametrize("version, kwargs, rows", HISTORY_KEPT,
                         ids=["qwen3.5-tools", "qwen3.6-tools", "qwen3.6-preserve", "qwen3.6-preserve-no-thinking"])
def test_a_kept_history_makes_each_turn_a_prefix_of_the_next(tmp_path, toks, tokenizer, version, kwargs, rows):
    tok = toks[tokenizer]
    for one in ([rows[0]], rows):
        examples, ids = _each(tmp_path, one, tok, version, **kwargs)
        tree, p = _tree(examples), len(examples[0].prefix_ids)
        ends = []  # per conversation, its last turn's example
        for row in one:
            renders = _renders(tok, row, version, **kwargs)
            first = ends[-1] + 1 if ends else 0  # its first turn's example
            for j in range(first, first + len(renders) - 1):
                assert renders[j - first + 1][0].startswith(renders[j - first][1])  # the text keeps the turn
                assert _is_prefix(ids[j], ids[j + 1])  # and so do the tokens
                assert tree.paths[j] == tree.paths[j + 1][: len(tree.paths[j])]
                ex, last = examples[j], tree.nodes[tree.paths[j][-1]]
                # turn j's target ends its last node, which turn j + 1 runs through: an interior node
                assert last.end == ex.len_continuation and last.children
                assert tree.node_at(j, len(ex.item_ids)) in tree.paths[j + 1]
            ends.append(first + len(renders) - 1)
        longest = [ids[e] for e in ends]
        if len(one) == 1:
            assert tree.positions == len(longest[0]) - p
        else:  # the longest path plus the other's tokens past what it shares with it
            shared = len(os.path.commonprefix([longest[0], longest[1]]))
            assert tree.positions == len(longest[0]) - p + len(longest[1]) - shared
            assert tree.positions == distinct_prefixes(ids) - p


# --- rendered the same, tokenized otherwise --------------------------------------------------------------------------

def test_a_turn_the_next_prompt_tokenizes_otherwise_parts_the_tree_there(tmp_path, toks):
    """Thinking on, no reasoning, Qwen3.6's preserve_thinking: turn k's text is a prefix of turn k+1's prompt, but as
    generated it is <think> \\n | \\n </think> (its prompt, then its own piece) where the next prompt, tokenized whole,
    reads <think> \\n\\n </think>. Each example keeps its own tokens (the reference's), so the tree shares turn k
    only through <think>; the later turns share the history as their prompts read it. With the bundled tokenizer
    (no \\n\\n token) and with thinking off (the empty think block is prompt) the turns are one chain."""
    rows = [tutoring(0, 4, reasoning=False)]
    kwargs = {"preserve_thinking": True}
    tok = toks["qwen-like"]
    examples, ids = _each(tmp_path, rows, tok, "qwen3.6", **kwargs)
    tree, p = _tree(examples), len(examples[0].prefix_ids)
    renders = _renders(tok, rows[0], "qwen3.6", **kwargs)
    for j in range(len(examples) - 1):
        assert renders[j + 1][0].startswith(renders[j][1])  # rendered the same
        head = renders[j][0][: -len("\n")]  # the prompt through <think>
        parted = len(_ids(tok, head))
        assert ids[j][:parted] == ids[j + 1][:parted] and ids[j][parted] != ids[j + 1][parted]
        assert tok.convert_ids_to_tokens([ids[j][parted], ids[j + 1][parted]]) == ["Ċ", "ĊĊ"]
        leaf = tree.nodes[tree.paths[j][-1]]
        assert leaf.start == parted - p and not leaf.children
        if j + 2 < len(examples):  # turns j + 1 and j + 2 read turn j the same: past it, they still share
            assert tree.paths[j + 1][-1] not in tree.paths[j + 2] and tree.paths[j + 1][-2] in tree.paths[j + 2]
    assert tree.positions == distinct_prefixes(ids) - p > max(map(len, ids)) - p
    for tokenizer, extra in (("bundled", {}), ("qwen-like", {"enable_thinking": False})):
        examples, ids = _each(tmp_path, rows, toks[tokenizer], "qwen3.6", **kwargs, **extra)
        assert example_tree(examples).positions == len(ids[-1]) - len(examples[0].prefix_ids)


# --- through the CLI -------------------------------------------------------------------------------------------------

def test_tree_train_and_eval_of_official_template_chat_equal_standalone(tmp_path):
    """Two tutoring conversations (reasoning dropped: shared histories, turn leaves) and a tool loop (history kept:
    targets on interior nodes), Qwen3.6's template, the Qwen-like tokenizer, train_on: each."""
    version, tok = "qwen3.6", load_tokenizer(QWEN_LIKE)
    rows = [tutoring(i, 3) for i in range(2)] + [tool_loop(0)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = write_config(tmp_path, optim=SGD, data={"train": data, "eval": None, "train_on": "each",
                                                  "chat_template": str(official_template_path(version)),
                                                  "tokenizer": str(QWEN_LIKE)},
                       packing={"token_budget": 2400, "max_continuations": 16},
                       train={"epochs": 1, "packs_per_step": 100})
    stats = json.loads(run_in_process("plan", cfg, "--json", "--set", "packing.mode=tree").stdout)
    # the reference's sequences, by prompt group (the tool loop's P holds its tools): one pack each, whose tree
    # counts each distinct prefix of its group's sequences once (P's tokens included)
    groups = [[ids for row in rows if bool(row.get("tools")) == tools for _, ids, _ in
               reference_examples(tok, row, "each", True, official_generated_text(version),
                                  official_template_path(version).read_text())] for tools in (False, True)]
    assert stats["examples"] == 9 and stats["packs"] == 2
    assert stats["positions_packed"] == sum(map(distinct_prefixes, groups)) < stats["positions_shared_prefix"]

    assert_tree_trains_as_standalone(cfg, tmp_path, 9)
