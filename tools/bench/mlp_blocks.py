"""The bench cpu model's MLP (hidden 256, intermediate 768, SiLU gate, float32) forward + backward per row: over a
pack-sized buffer in one piece, in blocks of rows (packtrain's CPU back end runs a pack's MLPs in blocks of
``kernels.CPU_MLP_ROWS``), and over an example-sized buffer. CPU time of this process, one thread, median of
interleaved repeats.

    python tools/bench/mlp_blocks.py [--rows 3119] [--example-rows 1190] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3119, help="the pack's buffer (P 1,024 + 12 of 100-230)")
    ap.add_argument("--example-rows", type=int, default=1190, help="one of its examples")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gate, up, down = (torch.nn.Linear(a, b, bias=False).requires_grad_(False)
                      for a, b in ((256, 768), (256, 768), (768, 256)))

    def mlp(x):
        return down(F.silu(gate(x)) * up(x))

    def case(rows: int, block: int | None):
        x = torch.randn(rows, 256, requires_grad=True)

        def run():
            y = torch.cat([mlp(b) for b in x.split(block)]) if block else mlp(x)
            y.sum().backward()
        return rows, run

    cases = {f"{args.rows} rows in one piece": case(args.rows, None),
             **{f"{args.rows} rows in blocks of {b}": case(args.rows, b) for b in (256, 512, 1024)},
             f"{args.example_rows} rows in one piece": case(args.example_rows, None)}
    times = {name: [] for name in cases}
    for r in range(args.repeats + 1):
        for name, (rows, run) in cases.items():
            c0 = time.process_time()
            run()
            if r:  # the first round warms up
                times[name].append((time.process_time() - c0) / rows)
    for name, ts in times.items():
        print(f"{name:<32} {statistics.median(ts) * 1e6:7.2f} us per row")


if __name__ == "__main__":
    main()
