"""The bench's presets and their generated data (packtrain/bench/presets.py): random token ids in the preset's shape,
seeded; one long continuation among short ones; conversations whose turns carry their whole history; preference
pairs sharing P and the item; and a preset handed out as a copy."""

import pytest

from packtrain.bench.presets import PRESETS, Shape, generate_examples, get_preset


def test_a_continuation_needs_an_item_and_a_target_token():
    with pytest.raises(ValueError, match="continuations of at least 2 tokens"):
        generate_examples(Shape(prompts=1, prefix_tokens=4, continuations=2, cont_tokens=(1, 3)), vocab=50)


def test_generated_examples_follow_the_shape():
    shape = Shape(prompts=2, prefix_tokens=7, continuations=3, cont_tokens=(4, 9))
    examples = generate_examples(shape, vocab=50, seed=1)
    assert len(examples) == 6 and len({ex.prefix_ids for ex in examples}) == 2
    assert all(len(ex.prefix_ids) == 7 and 4 <= ex.len_continuation <= 9 and ex.target_ids for ex in examples)
    assert all(0 < t < 50 for ex in examples for t in ex.prefix_ids + ex.item_ids + ex.target_ids)
    assert generate_examples(shape, vocab=50, seed=1) == examples


def test_extra_continuations_join_each_prompt():
    # one long continuation among short ones: 3 of 4-6 tokens and one of exactly 40, per prompt
    shape = Shape(prompts=2, prefix_tokens=5, continuations=3, cont_tokens=(4, 6), extra=((1, 40, 40),))
    examples = generate_examples(shape, vocab=50, seed=2)
    lengths = [ex.len_continuation for ex in examples]
    assert len(examples) == 8 and lengths[3] == lengths[7] == 40
    assert all(4 <= n <= 6 for i, n in enumerate(lengths) if i % 4 != 3)
    # without extras the generated data is what it was before the option existed
    plain = Shape(prompts=2, prefix_tokens=5, continuations=3, cont_tokens=(4, 6))
    assert generate_examples(plain, 50, 2)[:3] == examples[:3]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        generate_examples(Shape(1, 5, 3, (4, 6), extra=((1, 1, 1),)), vocab=50)


def test_generated_turns_carry_their_whole_history():
    """--turns: each conversation's turn k is an example whose item is turns 0..k-1 (user + answer) and turn k's
    user half, whose target is turn k's answer (what ``train_on: each`` makes of a conversation)."""
    shape = Shape(prompts=1, prefix_tokens=3, continuations=2, cont_tokens=(4, 5), turns=(2, 3))
    examples = generate_examples(shape, vocab=50, seed=3)
    by_conversation = {}
    for ex in examples:
        by_conversation.setdefault(ex.id.rsplit("-t", 1)[0], []).append(ex)
    assert len(by_conversation) == 2 and all(2 <= len(turns) <= 3 for turns in by_conversation.values())
    for turns in by_conversation.values():
        history = ()
        for ex in turns:
            turn = len(ex.item_ids) - len(history) + len(ex.target_ids)
            assert ex.item_ids[:len(history)] == history and 4 <= turn <= 5 and len(ex.target_ids) == turn // 2
            history = ex.item_ids + ex.target_ids


def test_generated_pairs_share_p_and_the_item():
    """--preset dpo: each continuation a pair, chosen and rejected, of one item (the first half of its drawn length)
    and two answers of the second half's length, other random tokens."""
    shape = Shape(prompts=2, prefix_tokens=4, continuations=3, cont_tokens=(6, 11), pairs=True)
    examples = generate_examples(shape, vocab=1000, seed=4)
    assert [ex.id for ex in examples[:2]] == ["p0-c0:chosen", "p0-c0:rejected"] and len(examples) == 12
    for chosen, rejected in zip(examples[::2], examples[1::2]):
        assert (chosen.pair, chosen.side, rejected.pair, rejected.side) == (chosen.id[:-7], "chosen", chosen.id[:-7],
                                                                            "rejected")
        assert (chosen.prefix_ids, chosen.item_ids) == (rejected.prefix_ids, rejected.item_ids)
        n = chosen.len_continuation
        assert 6 <= n <= 11 and len(chosen.item_ids) == n - n // 2 and len(rejected.target_ids) == n // 2
        assert chosen.target_ids != rejected.target_ids
    assert len({ex.prefix_ids for ex in examples}) == 2


def test_a_preset_is_handed_out_as_a_copy():
    preset = get_preset("tiny")
    preset.config["model"]["config"]["hidden_size"] = 7
    preset.config["train"]["seed"] = 9
    assert PRESETS["tiny"].config["model"]["config"]["hidden_size"] == 32 and PRESETS["tiny"].config["train"]["seed"] == 0
    assert get_preset("dpo").config["train"]["objective"] == "dpo"
    assert get_preset("rl").config["train"]["objective"] == "grpo"
    with pytest.raises(ValueError, match=r"^--preset: unknown preset 'huge' \(known: tiny, cpu, gpu, tree, dpo, rl\)$"):
        get_preset("huge")
