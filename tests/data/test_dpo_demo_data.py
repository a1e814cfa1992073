"""tools/data/make_dpo_demo_data.py: the committed data/dpo_demo is what the generator writes (so it is
deterministic across processes), and every pair is right where it should be and wrong where it should be, checked
against the code tables read back from the system prompts, not against the generator's own tables."""

import importlib
import json
import re
import sys

import pytest
from cli_helpers import REPO

from packtrain.data.jsonl import load_tokenizer

DATA = REPO / "data" / "dpo_demo"
TABLE_ROW = re.compile(r"^- (\w+) is written (\w+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def generator():
    """The script as a module, imported as ``python tools/data/...`` runs it (its folder first on sys.path)."""
    before = list(sys.path)
    sys.path.insert(0, str(REPO / "tools" / "data"))
    try:
        yield importlib.import_module("make_dpo_demo_data")
    finally:
        sys.path[:] = before
        for name in ("make_dpo_demo_data", "make_demo_data"):
            sys.modules.pop(name, None)


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def committed() -> dict[str, list[dict]]:
    return {split: _read(DATA / f"{split}.jsonl") for split in ("train", "eval")}


def _table(system: str) -> dict[str, str]:
    table = dict(TABLE_ROW.findall(system))
    assert len(table) == 16 and len(set(table.values())) == 16, system
    return table


def _words(item: str) -> list[str]:
    assert item.startswith("Encode: "), item
    return item.removeprefix("Encode: ").split()


def test_the_generator_is_deterministic_and_wrote_the_committed_files(generator, committed):
    first, second = generator.build(0, 120, 1, 2), generator.build(0, 120, 1, 2)
    assert first == second
    assert (first[0], first[1]) == (committed["train"], committed["eval"])  # written by another process


def test_another_seed_gives_other_pairs(generator, committed):
    train, _ = generator.build(1, 120, 1, 2)
    assert train != committed["train"]


def test_every_pair_is_a_text_preference_pair_with_a_unique_id(committed):
    records = committed["train"] + committed["eval"]
    assert all(set(r) == {"id", "system", "item", "chosen", "rejected"} for r in records)
    assert len({r["id"] for r in records}) == len(records)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_chosen_is_right_and_rejected_is_wrong_under_the_pairs_rulebook(committed, split):
    records = committed[split]
    tables = {r["system"]: _table(r["system"]) for r in records}
    assert len(tables) == 5
    for r in records:
        words, table = _words(r["item"]), tables[r["system"]]
        right = " ".join(table[w] for w in words)
        assert r["chosen"] == right, r
        assert r["rejected"] != right and r["rejected"] != r["chosen"], r
        assert len(r["rejected"].split()) == len(words), r  # one code per word: well formed, only wrong


@pytest.mark.parametrize("split", ["train", "eval"])
def test_rejected_answers_are_of_every_kind_and_only_those(committed, split):
    """Each rejected answer is another rulebook's codes for the words, the codes swapped, or one word's code
    replaced by another word's of the same table; each kind is at least a sixth of the pairs."""
    records = committed[split]
    tables = {r["system"]: _table(r["system"]) for r in records}
    counts = {"rulebook": 0, "swap": 0, "word": 0}
    for r in records:
        words, table = _words(r["item"]), tables[r["system"]]
        codes = [table[w] for w in words]
        rejected = r["rejected"].split()
        if any(rejected == [t[w] for w in words] for s, t in tables.items() if s != r["system"]):
            counts["rulebook"] += 1
        elif len(words) == 2 and rejected == codes[::-1]:
            counts["swap"] += 1
        elif sum(a != b for a, b in zip(rejected, codes)) == 1 and set(rejected) <= set(table.values()):
            counts["word"] += 1
        else:
            pytest.fail(f"rejected answer of no kind: {r}")
    assert min(counts.values()) >= len(records) / 6, counts


@pytest.mark.parametrize("split", ["train", "eval"])
def test_chosen_and_rejected_have_the_same_token_count(committed, split):
    tokenizer = load_tokenizer()
    for r in committed[split]:
        chosen, rejected = (tokenizer(r[k], add_special_tokens=False)["input_ids"] for k in ("chosen", "rejected"))
        assert len(chosen) == len(rejected), (r, chosen, rejected)


def test_the_pairs_ask_the_demos_requests_and_hold_out_its_eval_ones(committed):
    """Train pairs ask data/demo's training requests under its rulebooks and as many more of each rulebook, one pair
    each; held-out pairs ask its eval requests, two pairs each: no held-out request is trained on under its
    rulebook."""
    demo = {split: {(r["system"], r["item"]) for r in _read(REPO / "data" / "demo" / f"{split}.jsonl")}
            for split in ("train", "eval")}
    asked = {split: [(r["system"], r["item"]) for r in committed[split]] for split in ("train", "eval")}
    train, held_out = set(asked["train"]), set(asked["eval"])
    assert len(train) == len(asked["train"]) == 600  # one pair per request
    assert demo["train"] < train and held_out == demo["eval"] and len(asked["eval"]) == 2 * len(held_out)
    assert not train & held_out
    per_rulebook = {}
    for system, _ in train:
        per_rulebook[system] = per_rulebook.get(system, 0) + 1
    assert sorted(per_rulebook.values()) == [120] * 5
