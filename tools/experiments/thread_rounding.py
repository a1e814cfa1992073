"""Does torch's CPU flash attention round the same with 1 and 2 threads? One process, the same inputs, causal
self-attention [1, 4 heads, T, 16] for T = 1..130 and a few longer, float64 and float32; prints the lengths whose
outputs differ bitwise between the two thread counts, and the largest difference.

    python tools/experiments/thread_rounding.py

The recorded run and why tests/run/test_preemption.py compares runs with one thread count: docs/performance.md
(``thread_rounding.py``).
"""

from __future__ import annotations

import argparse

import torch

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        differ, worst = [], 0.0
        for T in [*range(1, 131), 255, 256, 257, 511, 513, 700, 1000]:
            q, k, v = (torch.randn(1, 4, T, 16, generator=g, dtype=dtype) for _ in range(3))
            outs = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outs.append(FLASH(q, k, v, 0.0, True, scale=0.25)[0])
            if not torch.equal(*outs):
                differ.append(T)
                worst = max(worst, (outs[0] - outs[1]).abs().max().item())
        print(f"{str(dtype):15s} outputs differ between 1 and 2 threads for T = {differ or 'none'}"
              + (f" (largest difference {worst:.1e})" if differ else ""))


if __name__ == "__main__":
    main()
