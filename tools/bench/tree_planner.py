"""Time the tree planner (``packing.mode: tree``) on 1,000,000 generated multi-turn examples (a benchmark, not a
test; docs/performance.md has the figures).

The generated data: conversations of 8-24 turns trained under ``data.train_on: each`` (one example per assistant
turn, its item the whole history before it), each drawing one of 100 system prompts P of 2,000 tokens. Turns are
short (user 5-20 tokens, assistant 10-40) so a million examples fit in memory; a token's ids come from one pool of
int objects, as a tokenizer's would be shared. Half the conversations keep their history as rendered (turn k's
example is a prefix of turn k+1's: a chain), half drop each earlier turn's reasoning (8 tokens) from the history, as
Qwen's templates do (the history an interior node, each turn with its reasoning a leaf). Generating is not timed.

    PYTHONPATH=. python tools/bench/tree_planner.py                  # the figure in docs/performance.md
    PYTHONPATH=. python tools/bench/tree_planner.py --examples 100000

(``PYTHONPATH=.``: a script run from tools/ imports the installed packtrain, not this tree's, otherwise.)
"""

from __future__ import annotations

import argparse
import platform
import random
import time

from packtrain.data.jsonl import Example
from packtrain.data.planner import plan_stats, plan_tree_packs

VOCAB = list(range(50_000))


def conversation(rng: random.Random, prefix: tuple[int, ...], name: str, drop_reasoning: bool) -> list[Example]:
    """One conversation's examples under ``each``."""
    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.choices(VOCAB, k=n))

    history: tuple[int, ...] = ()
    out = []
    for turn in range(rng.randint(8, 24)):
        user, answer, reasoning = tokens(rng.randint(5, 20)), tokens(rng.randint(10, 40)), tokens(8)
        item = history + user
        target = reasoning + answer if drop_reasoning else answer
        out.append(Example(f"{name}.{turn}", prefix, item, target))
        history = item + answer if drop_reasoning else item + target
    return out


def generate(n_examples: int, n_prompts: int, p_len: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    prompts = [tuple(rng.choices(VOCAB, k=p_len)) for _ in range(n_prompts)]
    examples: list[Example] = []
    while len(examples) < n_examples:
        c = len(examples)
        examples += conversation(rng, rng.choice(prompts), f"c{c}", c % 2 == 1)
    return examples[:n_examples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1_000_000)
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--prefix", type=int, default=2_000)
    parser.add_argument("--token-budget", type=int, default=16_384)
    parser.add_argument("--max-continuations", type=int, default=90)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    examples = generate(args.examples, args.prompts, args.prefix, args.seed)
    t1, c1 = time.perf_counter(), time.process_time()
    plan = plan_tree_packs(examples, args.token_budget, args.max_continuations, seed=args.seed)
    t2, c2 = time.perf_counter(), time.process_time()
    stats = plan_stats(plan, examples)
    t3 = time.perf_counter()

    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor() or 'cpu'}")
    print(f"generated {len(examples):,} examples over {args.prompts:,} prompts in {t1 - t0:.1f} s (not counted)")
    print(f"plan_tree_packs {t2 - t1:6.2f} s  -> {stats['packs']:,} packs, "
          f"{stats['continuations_min']}/{stats['continuations_median']}/{stats['continuations_max']} examples "
          f"per pack (min/median/max), {stats['budget_utilisation']:.1%} of the budget used; {c2 - c1:.2f} s of CPU")
    print(f"plan_stats      {t3 - t2:6.2f} s  -> positions: standalone {stats['positions_standalone']:,}, "
          f"shared_prefix {stats['positions_shared_prefix']:,}, tree {stats['positions_packed']:,} "
          f"({stats['shared_prefix_position_ratio']:.1f}x fewer than shared_prefix)")


if __name__ == "__main__":
    main()
