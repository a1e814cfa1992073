"""packtrain's torch chunk rule vs transformers' torch fallback on the same input: forward + backward, CPU time of
this process (one thread), median of interleaved repeats. The default shape is the bench cpu preset's GDN layer
(2 key heads, 4 value heads, head dims 64) over a P of 2,048 tokens.

    python tools/bench_chunk_rule.py [--tokens 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from packtrain.kernels import torch_ref


def inputs(T: int, H: int, HV: int, K: int, seed: int = 0):
    """q, k, v split off one projection (as in the model) and a gate, all leaves of one graph."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(1, T, 2 * H * K + HV * K, generator=g, requires_grad=True)
    a = torch.randn(1, T, HV, generator=g, requires_grad=True)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * K], dim=-1)
    return (q.reshape(1, T, H, K), k.reshape(1, T, H, K), v.reshape(1, T, HV, K), -F.softplus(a), a.sigmoid())


def timed(rule, args) -> float:
    c0 = time.process_time()
    out, _ = rule(*args, use_qk_l2norm_in_kernel=True, output_final_state=True)
    (out * out).sum().backward()
    return time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rules = {"packtrain torch_ref": torch_ref.chunk_gated_delta_rule,
             "transformers fallback": getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)}
    times = {name: [] for name in rules}
    for r in range(args.repeats + 1):
        for name, rule in rules.items():
            t = timed(rule, inputs(args.tokens, 2, 4, 64))
            if r:  # the first round warms up
                times[name].append(t)
    base = statistics.median(times["transformers fallback"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<24} {med * 1e3:8.1f} ms  ({base / med:.2f}x transformers' speed)")


if __name__ == "__main__":
    main()
