"""Balanced steps at 64 ranks: the utilisation (mean / largest rank cost per step, over an epoch) of
``train.balance: cost`` against ``round_robin``, on generated data planned by packtrain's own planner (a benchmark,
not a test; docs/performance.md, "Balanced steps", has the figures).

Two distributions, seeded:
- ``seed-like`` (the design's data): 300 prompts with P of 20K-64K tokens, each with 300-1,500 examples whose
  continuations are 350-2,100 tokens, under the default budget (150,000 positions, at most 90 continuations): a
  median of 74 continuations per pack;
- ``planner-bench``: tools/bench/planner.py's data (P of 1K-8K, about 500 examples per prompt, continuations
  97-6,008 tokens).

The cost model is Qwen3.6-27B's (configs/qwen3.6-27b.yaml): FLOPs per position and per attention pair.

    python tools/bench/balance.py                       # both, 64 ranks, one pack per rank per step
    python tools/bench/balance.py --world-size 8 --data seed-like
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools" / "bench"))

from planner import generate as planner_bench_data

from packtrain.config import load_config
from packtrain.data.jsonl import Example
from packtrain.data.planner import plan_packs
from packtrain.models.cost import CostModel
from packtrain.run.balance import BALANCES, distinct_prompts, epoch_steps, pack_costs, utilisation


def seed_like(seed: int) -> list[Example]:
    rng = random.Random(seed)
    base = tuple(rng.randrange(256) for _ in range(64_000))
    conts = {n: base[:n] for n in range(350, 2_101)}  # shared tuples: memory stays small
    examples = []
    for k in range(300):
        prefix = (k,) + base[:rng.randint(20_000, 64_000) - 1]  # distinct from the first token: cheap to sort
        for j in range(rng.randint(300, 1_500)):
            n = rng.randint(350, 2_100)
            examples.append(Example(f"p{k}-{j}", prefix, conts[n][:-1], conts[n][-1:]))
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--packs-per-rank", type=int, default=1, help="train.packs_per_step = this x world size")
    parser.add_argument("--data", choices=["seed-like", "planner-bench", "both"], default="both")
    parser.add_argument("--planner-bench-examples", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=3, help="epochs averaged (each its own shuffle)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = CostModel.for_config(load_config(REPO / "configs" / "qwen3.6-27b.yaml"))
    per_step = args.packs_per_rank * args.world_size
    print(f"cost model (Qwen3.6-27B): {model.describe()}; {args.world_size} ranks, {per_step} packs per step")
    print("| data | packs | continuations per pack (median) | balance | utilisation | distinct prompts per step | "
          "schedule s |")
    print("|---|---|---|---|---|---|---|")
    datasets = ["seed-like", "planner-bench"] if args.data == "both" else [args.data]
    for name in datasets:
        examples = seed_like(args.seed) if name == "seed-like" else planner_bench_data(
            args.planner_bench_examples, 2_000, args.seed)
        plan = plan_packs(examples, 150_000, 90, seed=args.seed)
        costs = pack_costs(plan, examples, model)
        median = statistics.median(len(p.examples) for p in plan.packs)
        for balance in BALANCES:
            t0 = time.perf_counter()
            scheds = [epoch_steps(plan, costs, e, args.seed, per_step, args.world_size, balance)
                      for e in range(args.epochs)]
            seconds = (time.perf_counter() - t0) / args.epochs
            u = statistics.mean(utilisation(s, costs) for s in scheds)
            d = statistics.mean(distinct_prompts(s, plan) for s in scheds)
            print(f"| {name} | {len(plan.packs):,} | {median:g} | {balance} | {u:.4f} | {d:.1f} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
