"""What the tree's fixed-order sums cost (packtrain/packed/gather.py): a tree config's training step on its largest
pack with the tree's row gathers as ``gather_rows`` (a sort, then each row's terms in sequence: the same bits on
every run) and as plain indexing ``x[index]`` (its backward adds the terms in parallel: other bits on each run),
interleaved in one process, the order of the two rotated per repeat. Prints each one's median step time and their
ratio.

    OMP_NUM_THREADS=2 python tools/bench/gather.py [configs/dpo_demo.yaml] [--repeats 9] [--set KEY=VALUE ...]

A dpo config runs with ``train.dpo_reference: per_step`` here (no pass over the data before the step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from packtrain.config import load_config
from packtrain.distributed import DistInfo
from packtrain.packed import gather, tree
from packtrain.run.harness import one_pack, one_update, update_step
from packtrain.run.session import open_session

WAYS = {"gather_rows (fixed order)": gather.gather_rows, "x[index] (parallel adds)": lambda x, index: x[index]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="configs/dpo_demo.yaml")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, [*args.overrides, "train.dpo_reference=per_step", "packing.mode=tree"])
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    session = open_session(cfg, info, "train")
    session.build_model()
    one, unit = one_pack(session.plan, session.examples, session.kinds, cfg.train.max_positions)
    step = update_step(cfg, session.lm, session.kinds, one, session.examples, info, steps=2 * args.repeats + 2)
    print(f"{args.config}: the largest pack, {len(unit.examples)} examples, {one.packs[0].positions:,} positions; "
          f"{torch.get_num_threads()} threads")
    one_update(step, 0)  # warm-up: the layout's caches, the allocator
    seconds: dict[str, list[float]] = {name: [] for name in WAYS}
    names = list(WAYS)
    for r in range(args.repeats):
        for name in names[r % 2:] + names[:r % 2]:
            tree.gather_rows = WAYS[name]
            t0 = time.perf_counter()
            one_update(step, 1 + len(seconds[name]))
            seconds[name].append(time.perf_counter() - t0)
    tree.gather_rows = gather.gather_rows
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    for name, median in medians.items():
        print(f"  {name}: median {median:.3f} s of {args.repeats}")
    fixed, parallel = medians.values()
    print(f"  fixed order / parallel: {fixed / parallel:.3f}")


if __name__ == "__main__":
    main()
