"""Peak memory and time of the target-only head + cross-entropy (packtrain/packed/loss.py) against
``train.loss_chunk_rows``, on CPU.

    OMP_NUM_THREADS=1 python tools/bench/loss_chunks.py [--targets 1024] [--hidden 256] [--rows 0 128 256 512]

Each chunk size runs in its own child process: one forward + backward of ``target_losses`` on ``--targets`` float32
hidden rows through a float32 head of the real vocabulary (248,320) at width ``--hidden``. The parent reads the
child's peak RSS from ``wait4`` (from outside the process); the child reports its resident set before the loss
(the head and the hidden rows) and its wall time, so the table gives the loss's own peak above that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VOCAB = 248_320


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def child(targets: int, hidden: int, rows: int) -> None:
    import torch

    from packtrain.packed.loss import target_losses

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, VOCAB, bias=False)
    hidden_MD = torch.randn(targets, hidden, requires_grad=True)
    ids = torch.randint(VOCAB, (targets,))
    before = _rss_bytes()
    t0 = time.perf_counter()
    target_losses(head, hidden_MD, ids, rows).sum().backward()
    print(json.dumps({"seconds": time.perf_counter() - t0, "before": before}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, nargs="+", default=[0, 128, 256, 512])
    ap.add_argument("--child", type=int, nargs=3)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    print(f"| loss_chunk_rows | loss peak above the head (MiB) | seconds |  ({args.targets:,} targets, hidden "
          f"{args.hidden}, vocabulary {VOCAB:,}, float32)")
    print("|---|---|---|")
    for rows in args.rows:
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(args.targets), str(args.hidden), str(rows)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        assert status == 0, (rows, status)
        report = json.loads(out.strip().splitlines()[-1])
        peak = usage.ru_maxrss * 1024 - report["before"]
        label = f"{rows:,}" if rows else "0 (one chunk)"
        print(f"| {label} | {peak / 2**20:,.0f} | {report['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
