"""Write the preference demo data: data/dpo_demo/train.jsonl and data/dpo_demo/eval.jsonl (text preference format,
``{"id", "system", "item", "chosen", "rejected"}``), seeded and deterministic.

The demo's five rulebooks and its requests (tools/data/make_demo_data.py, the same seed): the training pairs ask the
demo's training requests and as many more of each rulebook (drawn from the requests data/demo never asks under it),
the held-out pairs its eval requests, none of which a training pair asks under the same rulebook. ``chosen`` is the
request's codes under its own rulebook; ``rejected`` is a wrong answer of one of three kinds, in turn:

- rulebook: the codes the same words have under another rulebook (only reading P tells them apart);
- swap: a two-word request's codes in the wrong order;
- word: one word's code replaced by the code of another word of the same table.

A rejected answer has as many tokens (bundled tokenizer) as its chosen one, so the summed log-probabilities of DPO
cannot tell them apart by length.

With the demo's 60 training requests alone (two pairs each) a held-out pair's (rulebook, word) codes had been seen as
chosen answers about 7 times, and the reward accuracy stayed near 0.88 however long configs/dpo_demo.yaml trained
(docs/performance.md, "The preference demo"): 120 requests of one pair each, the same 600 pairs, cover each code
twice as often.

    python tools/data/make_dpo_demo_data.py            # 600 train pairs + 120 held-out pairs
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from make_demo_data import (
    EVAL_PER_RULEBOOK,
    TRAIN_PER_RULEBOOK,
    WORDS,
    Rulebook,
    all_requests,
    answer_text,
    request_text,
    rulebooks,
    slug,
    write_splits,
)

from packtrain.data.jsonl import load_tokenizer

KINDS = ("rulebook", "swap", "word")


def wrong_answers(kind: str, words: list[str], codes: dict[str, str], others: list[dict[str, str]]) -> list[str]:
    """Every wrong answer of ``kind`` to the request ``words`` under the table ``codes`` (``others``: the other
    rulebooks' tables), each different from the right answer."""
    right = answer_text(words, codes)
    if kind == "rulebook":
        answers = [answer_text(words, other) for other in others]
    elif kind == "swap":
        answers = [answer_text(words[::-1], codes)]
    else:
        answers = [" ".join(codes[w] if j != i else codes[wrong] for j, w in enumerate(words))
                   for i in range(len(words)) for wrong in WORDS if wrong != words[i]]
    return sorted({a for a in answers if a != right})


def answerable(words: list[str], codes: dict[str, str], others: list[dict[str, str]], n_tokens) -> bool:
    """The request has a wrong answer of some kind with the right answer's token count."""
    right = n_tokens(answer_text(words, codes))
    return any(n_tokens(a) == right for kind in KINDS for a in wrong_answers(kind, words, codes, others))


def pairs(book: Rulebook, others: list[dict[str, str]], requests: list[tuple[int, list[str]]], split: str, per_request: int, rng: random.Random, n_tokens) -> list[dict]:
    """``per_request`` pairs for each request, their rejected answers of different kinds (taken in turn across the
    requests) and of the chosen answer's token count."""
    out = []
    for k, (index, words) in enumerate(requests):
        chosen = answer_text(words, book.codes)
        start = k * per_request
        used = set()
        for j in range(per_request):
            for step in range(len(KINDS)):  # this pair's kind, or the next one that has an answer of the same length
                kind = KINDS[(start + j + step) % len(KINDS)]
                candidates = [a for a in wrong_answers(kind, words, book.codes, others)
                              if a not in used and n_tokens(a) == n_tokens(chosen)]
                if candidates:
                    break
            else:
                raise SystemExit(f"no wrong answer of {n_tokens(chosen)} tokens for {words} in the {book.name}")
            rejected = rng.choice(candidates)
            used.add(rejected)
            out.append({"id": f"{slug(book.name)}-{split}-{index:03d}-{j}", "system": book.system,
                        "item": request_text(words), "chosen": chosen, "rejected": rejected})
    return out


def build(seed: int, train_requests: int, train_pairs_per_request: int,
          eval_pairs_per_request: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    books = rulebooks(rng, TRAIN_PER_RULEBOOK + EVAL_PER_RULEBOOK)  # the demo's rulebooks and requests
    tokenizer = load_tokenizer()
    lengths: dict[str, int] = {}

    def n_tokens(text: str) -> int:
        if text not in lengths:
            lengths[text] = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        return lengths[text]

    train, evals = [], []
    for book in books:
        others = [other.codes for other in books if other is not book]
        unasked = [w for w in all_requests() if w not in book.requests and answerable(w, book.codes, others, n_tokens)]
        rng.shuffle(unasked)
        asked = book.requests[:TRAIN_PER_RULEBOOK] + unasked[:max(0, train_requests - TRAIN_PER_RULEBOOK)]
        held_out = list(enumerate(book.requests[TRAIN_PER_RULEBOOK:], TRAIN_PER_RULEBOOK))
        train += pairs(book, others, list(enumerate(asked)), "train", train_pairs_per_request, rng, n_tokens)
        evals += pairs(book, others, held_out, "eval", eval_pairs_per_request, rng, n_tokens)
    rng.shuffle(train)
    rng.shuffle(evals)
    return train, evals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "data" / "dpo_demo"))
    parser.add_argument("--seed", type=int, default=0, help="the demo's seed (0): the demo's rulebooks")
    parser.add_argument("--train-requests", type=int, default=2 * TRAIN_PER_RULEBOOK,
                        help=f"training requests per rulebook: the demo's {TRAIN_PER_RULEBOOK}, then others it never "
                             "asks under that rulebook")
    parser.add_argument("--train-pairs-per-request", type=int, default=1, help="pairs for each training request")
    parser.add_argument("--eval-pairs-per-request", type=int, default=2,
                        help=f"held-out pairs for each of the demo's {EVAL_PER_RULEBOOK} eval requests per rulebook")
    args = parser.parse_args()
    train, evals = build(args.seed, args.train_requests, args.train_pairs_per_request, args.eval_pairs_per_request)
    write_splits(Path(args.out), train, evals, "held-out pairs")


if __name__ == "__main__":
    main()
