"""Where a pack spends more per position than the one-example-at-a-time loops: one forward + backward of a generated
pack (bench's cpu model) against every one of its examples through packtrain's standalone forward and the plain
transformers loop, in one process, one thread. Prints the CPU times (median of 3 interleaved) as fractions of the
position ratio, then self CPU time per operator under the torch profiler, the pack's scaled by the position ratio
(a row where the pack's figure is larger is work the pack does more of per position than the loops).

    python tools/bench/compare_ops.py --prefix-tokens 1024 --continuations 24 --cont-tokens 48:48
    python tools/bench/compare_ops.py --prefix-tokens 1024 --continuations 12 --cont-tokens 100:230 --shapes

``--shapes`` adds, for the largest operators, their calls grouped by input shape (matmul throughput per shape).
``--no-profile`` prints the timings only. ``--padded-attention`` also times the pack with the CPU attention's padded
path (the continuations' buckets against [P's keys ; their own keys] with a mask, what runs with attention dropout)
instead of the split one, interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import profile

from packtrain.bench.presets import Shape
from packtrain.bench.variants import VARIANTS, first_unit, one_pack_workload, whole_example
from packtrain.packed import attention
from packtrain.packed.lm import PackCall
from packtrain.run.step import rank_units
from packtrain.run.units import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--continuations", type=int, default=16)
    ap.add_argument("--cont-tokens", default="56:72")
    ap.add_argument("--rows", type=int, default=25, help="operators to print")
    ap.add_argument("--shapes", action="store_true", help="the largest operators by input shape")
    ap.add_argument("--no-profile", action="store_true", help="the timings only")
    ap.add_argument("--padded-attention", action="store_true", help="also time the pack on the padded attention path")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lo, _, hi = args.cont_tokens.partition(":")
    shape = Shape(1, args.prefix_tokens, args.continuations, (int(lo), int(hi or lo)))
    work, models = one_pack_workload(shape, "tools/bench/compare_ops.py")
    lm = models.lms["shared_prefix"]
    unit, layout = first_unit(work, "shared_prefix")
    examples = [work.examples[i] for i in unit.examples]  # the pack's: every loop below runs these
    alone = work.for_variant(VARIANTS["standalone"])
    singles = [alone.session.kinds.pack.call(build(u, alone.plan, alone.examples, alone.session.kinds).work)
               for ids in alone.steps for u in rank_units(alone.plan, ids, alone.session.kinds, 0, 1)
               if set(u.examples) <= set(unit.examples)]

    def pack():
        lm(PackCall(layout)).loss_sum.backward()

    def standalone():
        for single in singles:
            models.lms["standalone"](single).loss_sum.backward()

    def plain():
        for ex in examples:
            input_ids, labels = whole_example(ex, work.device)
            models.plain(input_ids=input_ids, labels=labels, use_cache=False).loss.backward()

    def pack_padded():
        split, attention._FLASH = attention._FLASH, None
        try:
            pack()
        finally:
            attention._FLASH = split

    runs = {"pack": pack, "standalone": standalone, "plain": plain}
    timed = {**runs, "pack_padded": pack_padded} if args.padded_attention else runs
    ratio = sum(len(ex.prefix_ids) + ex.len_continuation for ex in examples) / layout.length
    for fn in timed.values():  # warm-up
        fn()
    seconds = defaultdict(list)
    for _ in range(3):
        for name, fn in timed.items():
            c0 = time.process_time()
            fn()
            seconds[name].append(time.process_time() - c0)
    med = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"{shape.describe()}: position ratio {ratio:.2f}; CPU s (median of 3): "
          + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    print(f"pack's speedup / position ratio: vs standalone {med['standalone'] / med['pack'] / ratio:.3f}, "
          f"vs plain {med['plain'] / med['pack'] / ratio:.3f}")
    if args.padded_attention:
        print(f"pack with the split attention / with the padded one: {med['pack'] / med['pack_padded']:.3f}")
    if args.no_profile:
        return
    profiles = {}
    for name, fn in runs.items():
        with profile(record_shapes=args.shapes) as prof:
            fn()
        profiles[name] = prof
    totals = {name: defaultdict(float) for name in runs}
    for name, prof in profiles.items():
        for event in prof.key_averages():
            totals[name][event.key] += event.self_cpu_time_total / 1e6 * (ratio if name == "pack" else 1.0)
    ops = sorted(set().union(*totals.values()), key=lambda k: -totals["pack"].get(k, 0.0))
    print(f"\n| self CPU s | pack x {ratio:.2f} | standalone | plain |\n| --- | --- | --- | --- |")
    for op in ops[:args.rows]:
        print(f"| `{op}` | {totals['pack'].get(op, 0):.3f} | {totals['standalone'].get(op, 0):.3f} | "
              f"{totals['plain'].get(op, 0):.3f} |")
    print("| total | " + " | ".join(f"{sum(totals[n].values()):.3f}" for n in runs) + " |")
    if args.shapes:
        for op in ops[:3]:
            for name in ("pack", "standalone"):
                rows = [e for e in profiles[name].key_averages(group_by_input_shape=True) if e.key == op]
                rows.sort(key=lambda e: -e.self_cpu_time_total)
                print(f"\n{op}, {name}: the 5 largest input shapes (ms per call, calls)")
                for e in rows[:5]:
                    print(f"  {e.self_cpu_time_total / 1e3 / e.count:8.2f} x{e.count:4d}  {e.input_shapes}")


if __name__ == "__main__":
    main()
