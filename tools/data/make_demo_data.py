"""Write the demo data set: data/demo/train.jsonl and data/demo/eval.jsonl (text format), seeded and deterministic.

Five rulebooks (the shared system prompts, a few hundred tokens each with the bundled tokenizer) each define their
own code for the same sixteen words, plus filler rules and worked examples. An item asks for the codes of one or two
words; the target is those codes ("toma kelu"), a few tokens. The same item has a different target under each
rulebook, so a model can only get it right by reading the rulebook it is given.

    python tools/data/make_demo_data.py            # 300 train + 60 eval examples
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import NamedTuple

WORDS = [
    "falcon", "river", "lantern", "copper", "meadow", "harbor", "violet", "thunder",
    "marble", "orchard", "glacier", "ember", "willow", "canyon", "saffron", "beacon",
]
SYLLABLES = ["ka", "lo", "mi", "ru", "te", "zu", "no", "pa", "shi", "vo", "ge", "bi", "da", "fe", "ho", "ju"]

RULEBOOK_NAMES = ["Amber Ledger", "Basalt Codex", "Cobalt Register", "Dune Almanac", "Elm Charter"]

FILLER_RULES = [
    "Answer with the codes only, separated by a single space, and nothing else.",
    "Codes are always written in lower case, even when the request is shouted.",
    "If a word appears twice in a request, its code is written twice, in the same order.",
    "Never explain an answer; the clerk who reads it already knows this rulebook.",
    "A request names one or two words; each word is looked up on its own.",
    "Punctuation in a request is ignored; only the words matter.",
    "The order of the codes follows the order of the words in the request.",
    "Codes from any other rulebook are wrong here, even when they look familiar.",
    "Do not add a full stop after the last code.",
    "Words are matched exactly: a word not in the table below is never asked for.",
    "The table is the only source of truth; memory of earlier tables must be set aside.",
    "When in doubt, read the table again from the top.",
]


def make_codes(rng: random.Random) -> dict[str, str]:
    """A fresh word -> code table: every code two syllables, all sixteen distinct."""
    codes: set[str] = set()
    while len(codes) < len(WORDS):
        codes.add(rng.choice(SYLLABLES) + rng.choice(SYLLABLES))
    shuffled = sorted(codes)
    rng.shuffle(shuffled)
    return dict(zip(WORDS, shuffled))


def request_text(words: list[str]) -> str:
    return "Encode: " + " ".join(words)


def answer_text(words: list[str], codes: dict[str, str]) -> str:
    return " ".join(codes[w] for w in words)


def make_rulebook(name: str, codes: dict[str, str], rng: random.Random) -> str:
    rules = rng.sample(FILLER_RULES, rng.randint(5, len(FILLER_RULES)))
    table = "\n".join(f"- {word} is written {code}" for word, code in codes.items())
    worked = [rng.sample(WORDS, rng.randint(1, 2)) for _ in range(rng.randint(2, 4))]
    examples = "\n".join(f"{request_text(w)}\nAnswer: {answer_text(w, codes)}" for w in worked)
    numbered = "\n".join(f"Rule {i}. {r}" for i, r in enumerate(rules, 1))
    return (
        f"You are the clerk of the {name}. Your only task is to turn words into codes using this rulebook.\n\n"
        f"General rules:\n{numbered}\n\nCode table of the {name}:\n{table}\n\nWorked examples:\n{examples}"
    )


def all_requests() -> list[list[str]]:
    return [[w] for w in WORDS] + [[a, b] for a in WORDS for b in WORDS if a != b]


TRAIN_PER_RULEBOOK, EVAL_PER_RULEBOOK = 60, 12  # the committed data/demo


class Rulebook(NamedTuple):
    name: str
    codes: dict[str, str]  # word -> code
    system: str  # the system prompt: rules, the code table, worked examples
    requests: list[list[str]]  # the words of each request


def rulebooks(rng: random.Random, requests_per_rulebook: int) -> list[Rulebook]:
    """Each rulebook and its requests, drawn from ``rng`` in this order: the demo's rulebooks are those of
    ``random.Random(seed)`` with ``TRAIN_PER_RULEBOOK + EVAL_PER_RULEBOOK`` requests each, the first
    ``TRAIN_PER_RULEBOOK`` of them its training requests."""
    books = []
    for name in RULEBOOK_NAMES:
        codes = make_codes(rng)
        system = make_rulebook(name, codes, rng)
        books.append(Rulebook(name, codes, system, rng.sample(all_requests(), requests_per_rulebook)))
    return books


def slug(name: str) -> str:
    return name.split()[0].lower()


def build(seed: int, train_per_rulebook: int, eval_per_rulebook: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    train, evals = [], []
    for name, codes, system, requests in rulebooks(rng, train_per_rulebook + eval_per_rulebook):
        for k, words in enumerate(requests):
            split, out = ("train", train) if k < train_per_rulebook else ("eval", evals)
            out.append({"id": f"{slug(name)}-{split}-{k:03d}", "system": system, "item": request_text(words),
                        "target": answer_text(words, codes)})
    rng.shuffle(train)
    rng.shuffle(evals)
    return train, evals


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def write_splits(out: Path, train: list[dict], evals: list[dict], what: str) -> None:
    """OUT/train.jsonl and OUT/eval.jsonl, and a line saying so."""
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", evals)
    print(f"wrote {len(train)} train and {len(evals)} {what} to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "data" / "demo"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-per-rulebook", type=int, default=TRAIN_PER_RULEBOOK)
    parser.add_argument("--eval-per-rulebook", type=int, default=EVAL_PER_RULEBOOK)
    args = parser.parse_args()
    train, evals = build(args.seed, args.train_per_rulebook, args.eval_per_rulebook)
    write_splits(Path(args.out), train, evals, "eval examples")


if __name__ == "__main__":
    main()
