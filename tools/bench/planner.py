"""Time the planner on 1,000,000 generated examples (a benchmark, not a test; docs/performance.md has the figures).

The generated data: 2,000 prompts with P of 1,000-8,000 tokens, each example drawing its prompt at random (about
500 examples a prompt) and a continuation of 97-6,008 tokens, planned under the default budget (150,000 positions,
at most 90 continuations per pack). Token tuples are shared between examples where they can be, to keep memory small;
generating the data is not timed.

    python tools/bench/planner.py                  # the figure in docs/performance.md
    python tools/bench/planner.py --examples 100000
"""

from __future__ import annotations

import argparse
import platform
import random
import time

from packtrain.data.jsonl import Example
from packtrain.data.planner import epoch_order, plan_packs, plan_stats


def generate(n_examples: int, n_prompts: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(256) for _ in range(rng.randint(1_000, 8_000))) for _ in range(n_prompts)]
    base = tuple(rng.randrange(256) for _ in range(6_000))
    items = {n: base[:n] for n in range(96, 6_001, 8)}  # continuation lengths on a grid of 8, plus the target
    targets = [tuple(rng.randrange(256) for _ in range(rng.randint(1, 8))) for _ in range(1_000)]
    item_lengths = list(items)
    examples = []
    for i in range(n_examples):
        examples.append(Example(f"ex{i}", rng.choice(prompts), items[rng.choice(item_lengths)], rng.choice(targets)))
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1_000_000)
    parser.add_argument("--prompts", type=int, default=2_000)
    parser.add_argument("--token-budget", type=int, default=150_000)
    parser.add_argument("--max-continuations", type=int, default=90)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    examples = generate(args.examples, args.prompts, args.seed)
    t1 = time.perf_counter()
    plan = plan_packs(examples, args.token_budget, args.max_continuations, seed=args.seed)
    t2 = time.perf_counter()
    stats = plan_stats(plan, examples)
    t3 = time.perf_counter()
    epoch_order(plan, 0)
    t4 = time.perf_counter()

    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor() or 'cpu'}")
    print(f"generated {len(examples):,} examples over {args.prompts:,} prompts in {t1 - t0:.1f} s (not counted)")
    print(f"plan_packs   {t2 - t1:6.2f} s  -> {stats['packs']:,} packs, "
          f"{stats['continuations_min']}/{stats['continuations_median']}/{stats['continuations_max']} continuations "
          f"per pack (min/median/max), {stats['budget_utilisation']:.1%} of the budget used")
    print(f"plan_stats   {t3 - t2:6.2f} s  -> positions {stats['position_ratio']:.1f}x fewer, attention pairs "
          f"{stats['attention_pair_ratio']:.1f}x fewer")
    print(f"epoch_order  {t4 - t3:6.2f} s")
    print(f"total        {t4 - t1:6.2f} s")


if __name__ == "__main__":
    main()
