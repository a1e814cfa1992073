"""Write a seed-like pretokenized data set: one P of 64,000 tokens shared by continuations of 400-700 item and
200-400 target tokens (seeded, deterministic), for the memory figures of docs/performance.md ("Memory").

    python tools/data/make_seed_data.py /tmp/seed.jsonl                 # 80 continuations: one pack of ~133K positions
    packtrain plan configs/qwen3.6-27b.yaml --set data.train=/tmp/seed.jsonl --set data.format=pretokenized \\
        --memory --measure --world-size 64
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def seed_records(prefix: int, continuations: int, vocab: int, seed: int):
    rng = random.Random(seed)
    p = [rng.randrange(vocab) for _ in range(prefix)]
    for i in range(continuations):
        yield {"id": f"seed-{i}", "prefix_ids": p,
               "item_ids": [rng.randrange(vocab) for _ in range(rng.randint(400, 700))],
               "target_ids": [rng.randrange(vocab) for _ in range(rng.randint(200, 400))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--prefix", type=int, default=64_000)
    ap.add_argument("--continuations", type=int, default=80)
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with args.out.open("w") as f:
        for record in seed_records(args.prefix, args.continuations, args.vocab, args.seed):
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
