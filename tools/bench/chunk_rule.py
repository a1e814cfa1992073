"""packtrain's torch chunk rule vs transformers' torch fallback on the same input: forward + backward, CPU time of
this process (one thread), median of interleaved repeats. The default shape is the bench cpu preset's GDN layer
(2 key heads, 4 value heads, head dims 64) over a P of 2,048 tokens; packtrain's rule in chunks of 64 (the
default, transformers' and fla's) and of 32 (what a pack's P runs in on the torch back end, packtrain/packed/gdn.py).

    python tools/bench/chunk_rule.py [--tokens 2048] [--repeats 7]
    python tools/bench/chunk_rule.py --varlen   # the continuations' chunk size (packtrain/packed/gdn.py)

``--varlen``: packtrain's varlen rule over the continuations of a few pack shapes, every one from one shared
initial state (as in a pack), forward + backward, for continuation chunks of 8, 16, 24 and 32 rows.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from packtrain.packed.kernels import torch_ref


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


VARLEN_SHAPES = {  # name -> continuation lengths (seeded)
    "24 of 48": lambda rng: [48] * 24,
    "16 of 56-72": lambda rng: [rng.randint(56, 72) for _ in range(16)],
    "12 of 100-230": lambda rng: [rng.randint(100, 230) for _ in range(12)],
    "8 of 500-1,000": lambda rng: [rng.randint(500, 1000) for _ in range(8)],
    "15 of 40-60 + 1 of 1,000": lambda rng: [rng.randint(40, 60) for _ in range(15)] + [1000],
}


def varlen_chunks(repeats: int) -> None:
    import random

    print(f"{'continuations':<26}" + "".join(f"{f'chunk {c}':>12}" for c in (8, 16, 24, 32)) + "   (ms)")
    for name, lengths_of in VARLEN_SHAPES.items():
        lengths = lengths_of(random.Random(0))
        state = torch.randn(1, 4, 64, 64, requires_grad=True)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        times = {c: [] for c in (8, 16, 24, 32)}
        for r in range(repeats + 1):
            for c in times:
                q, k, v, gate, beta = inputs(sum(lengths), 2, 4, 64)  # a fresh graph (not timed)
                c0 = time.process_time()
                out, _ = torch_ref.chunk_gated_delta_rule(q, k, v, gate, beta, initial_state=state.expand(
                    len(lengths), -1, -1, -1), cu_seqlens=cu, chunk_size=c, use_qk_l2norm_in_kernel=True)
                (out * out).sum().backward()
                if r:
                    times[c].append(time.process_time() - c0)
        print(f"{name:<26}" + "".join(f"{statistics.median(ts) * 1e3:12.1f}" for ts in times.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--varlen", action="store_true", help="the continuations' varlen rule by chunk size")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.varlen:
        return varlen_chunks(args.repeats)
    rules = {"packtrain torch_ref": torch_ref.chunk_gated_delta_rule,
             "packtrain, chunks of 32": functools.partial(torch_ref.chunk_gated_delta_rule, chunk_size=32),
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
