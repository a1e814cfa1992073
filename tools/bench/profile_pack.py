"""Where a pack's time goes: one forward + backward of the bench's cpu model on a generated pack, under the torch
profiler, self CPU time summed by kind of op; before that, the pack's CPU time and peak memory (median / largest of
three, resident set above the loaded models). One torch thread. Runs against an older checkout too
(``PYTHONPATH=CHECKOUT``), without ``--extra``.

    python tools/bench/profile_pack.py --prefix-tokens 2048 --continuations 16 --cont-tokens 56:72
    python tools/bench/profile_pack.py --prefix-tokens 2048 --continuations 15 --cont-tokens 40:60 --extra 1x1000
    python tools/bench/profile_pack.py --prefix-tokens 2048 --continuations 8 --cont-tokens 500:1000 --groups 4

``--groups G`` runs the pack as the trainer does with ``packing.continuation_groups: G`` (packtrain/packed/groups.py).

The profiler adds overhead and the machine's load scales every row, so read the shares, not the seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import profile

from packtrain.bench.presets import Shape
from packtrain.bench.timing import memory_in_use, release_memory
from packtrain.bench.variants import one_pack_workload
from packtrain.packed.lm import PackCall
from packtrain.run.harness import PeakMemory
from packtrain.run.step import rank_units
from packtrain.run.units import Kinds, build

KINDS = [  # (label, op names); the first match wins, the rest is "elementwise, copies, indexing"
    ("linear layers and LoRA (mm)", ("aten::mm", "aten::addmm")),
    ("attention kernels (SDPA forward + backward)", ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                                     "aten::_scaled_dot_product_flash_attention_for_cpu_backward")),
    ("GDN chunk rule: triangular solves", ("aten::linalg_solve_triangular",)),
    ("GDN chunk rule: batched matmuls (bmm)", ("aten::bmm",)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--continuations", type=int, default=16)
    ap.add_argument("--cont-tokens", default="56:72")
    ap.add_argument("--extra", action="append", default=[], metavar="COUNTxLEN[:LEN]")
    ap.add_argument("--groups", type=int, default=1, help="packing.continuation_groups (default 1: one forward)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lo, _, hi = args.cont_tokens.partition(":")
    shape = Shape(1, args.prefix_tokens, args.continuations, (int(lo), int(hi or lo)))
    if args.extra:
        from packtrain.commands.bench import parse_extra

        shape = Shape(*shape.__dict__.values(), extra=tuple(parse_extra(e) for e in args.extra))
    work, models = one_pack_workload(shape, "tools/bench/profile_pack.py")
    plan, examples = work.plan, work.examples
    setup = Kinds.named("shared_prefix", args.groups)
    (unit,) = rank_units(plan, work.steps[0], setup, 0, 1)
    if args.groups > 1:
        from packtrain.packed.groups import train_groups

        groups = build(unit, plan, examples, setup).work

        def step():
            train_groups(models.lm, groups, 1.0)
    else:
        layout = build(unit, plan, examples, setup).work

        def step():
            models.lm(PackCall(layout)).loss_sum.backward()

    step()  # warm-up (and the layout's cached indices)
    seconds, peaks = [], []
    for _ in range(3):
        release_memory(work.device)
        probe = PeakMemory(work.device)
        probe.reset()
        before, c0 = memory_in_use(work.device), time.process_time()
        step()
        seconds.append(time.process_time() - c0)
        peaks.append(probe.read()[0] - before)
    print(f"pack forward + backward ({args.groups} group{'s' * (args.groups > 1)}): "
          f"{statistics.median(seconds):.3f} s CPU (median of 3), peak memory "
          f"{max(peaks) / 2**20:,.0f} MiB above the models")
    with profile(record_shapes=True) as prof:
        step()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        kind = next((label for label, names in KINDS if event.key in names), "elementwise, copies, indexing")
        if event.key == "aten::bmm" and event.input_shapes and event.input_shapes[0][:1] == [1]:
            kind = KINDS[0][0]  # a batch of one: a linear layer on a block of rows (the CPU MLP blocks)
        totals[kind] += event.self_cpu_time_total / 1e6
    whole = sum(totals.values())
    positions = len(examples[0].prefix_ids) + sum(len(e.item_ids) + len(e.target_ids) for e in examples)
    print(f"pack: {shape.describe()}; {positions:,} positions; one forward + backward, self CPU time by kind")
    print("| kind of op | s | share |\n| --- | --- | --- |")
    for label, _ in KINDS + [("elementwise, copies, indexing", ())]:
        print(f"| {label} | {totals[label]:.2f} | {100 * totals[label] / whole:.0f}% |")
    print(f"| total (under the profiler) | {whole:.2f} | 100% |")


if __name__ == "__main__":
    main()
