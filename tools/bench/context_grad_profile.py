"""Where the time of one pack goes under each packing.context_grad (docs/performance.md).

    OMP_NUM_THREADS=1 python tools/bench/context_grad_profile.py [--repeats 5] [--prefix-tokens 2048]

The `cpu` bench preset's model and pack (P of 2,048 tokens, 16 continuations of 56-72), one thread. Forward and
backward of the same pack under full, kv_only and frozen, interleaved (the order rotated per repeat), medians;
then one profiled forward + backward per mode, self CPU time grouped by operator.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's packtrain, installed or not

from packtrain.bench.presets import generate_examples, get_preset
from packtrain.config import config_from_dict
from packtrain.models.build import build_base_model
from packtrain.models.wrap import assemble
from packtrain.packed.layout import Continuation, build_pack_layout
from packtrain.packed.lm import PackCall, PackedLM

MODES = ("full", "kv_only", "frozen")
GROUPS = {  # operator -> what it mostly is in this model
    "aten::mm": "linear layers (mm)", "aten::addmm": "linear layers (mm)",
    "aten::bmm": "GDN chunk rule", "aten::linalg_solve_triangular": "GDN chunk rule",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention (SDPA)",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention (SDPA)",
    "aten::copy_": "copies, cat, fill", "aten::cat": "copies, cat, fill", "aten::fill_": "copies, cat, fill",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefix-tokens", type=int)
    args = ap.parse_args()
    torch.set_num_threads(1)
    preset = get_preset("cpu")
    shape = preset.shape if args.prefix_tokens is None else dataclasses.replace(preset.shape,
                                                                               prefix_tokens=args.prefix_tokens)
    # no saving: the pack fits this CPU's memory many times over (what bench's choice takes here)
    train = {"activation_checkpointing": False, "offload": False, "loss_chunk_rows": 0, "mlp_chunk_rows": 0,
             "norm_chunk_rows": 0}
    cfg = config_from_dict({**preset.config, "train": {**preset.config["train"], **train}})
    examples = generate_examples(shape, cfg.model.config["vocab_size"], 0)
    model, _, _ = assemble(build_base_model(cfg), cfg, torch.device("cpu"))
    layout = build_pack_layout(examples[0].prefix_ids, [Continuation(e.item_ids, e.target_ids) for e in examples])
    lms = {m: PackedLM(model, m) for m in MODES}
    print(f"{shape.describe()}: {layout.length:,} positions, one thread")

    def step(mode):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = lms[mode](PackCall(layout))
        t1 = time.perf_counter()
        out.loss_sum.backward()
        return t1 - t0, time.perf_counter() - t1

    times = defaultdict(list)
    for r in range(args.repeats + 1):
        for mode in MODES[r % 3:] + MODES[:r % 3]:
            fwd, bwd = step(mode)
            if r:  # the first round warms up
                times[mode].append((fwd, bwd))
    base = statistics.median(f + b for f, b in times["full"])
    print(f"{'mode':<9}{'forward s':>11}{'backward s':>12}{'total s':>9}{'of full':>9}")
    for mode in MODES:
        fwd = statistics.median(f for f, _ in times[mode])
        bwd = statistics.median(b for _, b in times[mode])
        tot = statistics.median(f + b for f, b in times[mode])
        print(f"{mode:<9}{fwd:>11.2f}{bwd:>12.2f}{tot:>9.2f}{tot / base:>9.2f}")
    for mode in MODES:
        with profile() as prof:
            step(mode)
        groups = defaultdict(float)
        for e in prof.key_averages():
            groups[GROUPS.get(e.key, "other")] += e.self_cpu_time_total / 1e6
        print(f"{mode}: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
