"""What a benchmark run prints and writes: a table, ``bench.json`` and ``bench.png``."""

from __future__ import annotations

import json
from pathlib import Path

MiB = 2**20
BASE = "shared_prefix"  # the variant every other is timed against ("x shared")


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def speedups(result: dict, clock: str = "seconds") -> tuple[dict, dict, dict]:
    """(time of each other variant / shared_prefix's, that / the position ratio, final-loss rel. diff vs it);
    ``clock`` "seconds" (wall) or "cpu_seconds" (this process's CPU time)."""
    variants = result["variants"]
    base = variants.get(BASE, {})
    speed, of_ratio, loss_diff = {}, {}, {}
    for name, v in variants.items():
        if name == BASE or "seconds" not in v or "seconds" not in base:
            continue
        speed[name] = v[clock] / base[clock]
        # the one of the two that computes fewer positions: its speedup over the other against the other's positions
        # over its own (shared_prefix over standalone, a tree over shared_prefix); the same positions (kv_only,
        # frozen): the ratio does not apply
        if v["positions"] != base["positions"]:
            fewer, more = sorted([(base["positions"], base[clock]), (v["positions"], v[clock])])
            of_ratio[name] = (more[1] / fewer[1]) / (more[0] / fewer[0])
        loss_diff[name] = abs(base["final_loss"] - v["final_loss"]) / abs(v["final_loss"])
    return speed, of_ratio, loss_diff


def versus(result: dict, fast: str, slow: str, clock: str = "seconds") -> dict | None:
    """``fast`` against ``slow`` (the dpo and rl presets: the tree against standalone pairs or completions): the time
    ratio slow / fast, the position ratio slow / fast, and the first over the second (1.0: as fast as its positions
    say); None unless both ran."""
    a, b = result["variants"].get(fast, {}), result["variants"].get(slow, {})
    if clock not in a or clock not in b:
        return None
    speed, positions = b[clock] / a[clock], b["positions"] / a["positions"]
    return {"speedup": speed, "position_ratio": positions, "of_ratio": speed / positions}


def format_table(result: dict) -> str:
    r, m = result, result["machine"]
    load = f"load average {m['load_before']:.2f} before, {m['load_after']:.2f} after"
    plan = r["plan"]
    lines = [
        f"{r['title']}",
        f"  model     {r['model']['describe']}",
        f"  device    {m['device']}, torch {m['torch']}, transformers {m['transformers']}",
        (f"  plan      {plan['examples']} examples -> {plan['packs']} pack(s), {r['steps_per_epoch']} step(s) per epoch; "
         f"positions {plan['positions_standalone']:,} standalone vs {plan['positions_packed']:,} packed: position "
         f"ratio {r['position_ratio']:.2f}x"),
        (f"  timing    median of {r['repeats']} interleaved repeats of one epoch each, after an untimed memory pass"
         f"{' and a warm-up step of each variant' if r.get('warmup') else ''}; {load}"),
        "",
        (f"  {'variant':<14}{'s/epoch':>9}{'x shared':>10}{'of ratio':>10}{'positions/s':>13}{'target tok/s':>14}"
         f"{'peak MiB':>10}{'final loss':>13}{'MFU':>8}"),
    ]
    speed, of_ratio, _ = speedups(r)
    for name, v in r["variants"].items():
        if "seconds" not in v:
            lines.append(f"  {name:<14}{v['error']}")
            continue
        mfu = "-" if v["mfu"] is None else f"{100 * v['mfu']:.1f}%"
        lines.append(
            f"  {name:<14}{v['seconds']:>9.2f}{_fmt(speed.get(name, 1.0), '.2f'):>9}x{_fmt(of_ratio.get(name), '.2f'):>10}"
            f"{v['positions_per_s']:>13,.0f}{v['target_tokens_per_s']:>14,.0f}{v['peak_memory_bytes'] / MiB:>10,.0f}"
            f"{v['final_loss']:>13.6f}{mfu:>8}")
    # figures and ratios only: what a speedup should reach is the reader's call
    if not m["cuda"]:  # the table's "of ratio" is wall time; on the CPU also this process's CPU time (CUDA runs async)
        _, fraction, _ = speedups(r, "cpu_seconds")
        if fraction:
            lines.append("  of ratio (CPU time): " + "; ".join(f"{v:.2f} vs {n}" for n, v in fraction.items()))
    clocks = [("seconds", "wall")] + ([] if m["cuda"] else [("cpu_seconds", "CPU time")])
    for clock, label in clocks:
        what = {"dpo": "pairs", "rl": "completions"}.get(r.get("preset"))
        pairs = versus(r, "tree", "standalone", clock) if what else None
        if pairs is not None:
            lines.append(f"  tree vs standalone {what} ({label}): {pairs['speedup']:.2f}x faster, position ratio "
                         f"{pairs['position_ratio']:.2f}x: {pairs['of_ratio']:.2f} of the ratio")
    lines += [
        "  x shared: the variant's time / shared_prefix's (how much faster shared-prefix is); of ratio: that / the",
        "  position ratio (1.0 = the planner's ideal). peak MiB: what the run adds above the loaded models",
        (f"  ({'CUDA allocated' if m['cuda'] else 'resident set'}, in the memory pass). final loss: the trained "
         "adapter's mean loss."),
    ]
    lines += [f"  {note}" for note in r.get("notes", [])]
    if r["peak_tflops"]:
        lines.append(f"  MFU: model FLOPs/s / {r['peak_tflops']:g} TFLOP/s ({r['peak_source']})")
    return "\n".join(lines)


def write_json(result: dict, out_dir: Path) -> Path:
    path = out_dir / "bench.json"
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")  # NaN is not JSON: raised, never written
    return path


def plot(result: dict, out_dir: Path) -> Path | None:
    """Time per epoch, shared-prefix's speedup against the position ratio, and peak memory, in one PNG."""
    try:
        import matplotlib
    except ImportError:  # the GPU machine's environment has no matplotlib: the JSON carries everything
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {k: v for k, v in result["variants"].items() if "seconds" in v}
    names = list(ran)
    colours = {"shared_prefix": "tab:green", "kv_only": "tab:olive", "frozen": "tab:cyan", "standalone": "tab:blue",
               "plain": "tab:grey", "tree": "tab:purple"}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    seconds = [ran[n]["seconds"] for n in names]
    lo = [s - min(ran[n]["seconds_per_repeat"]) for n, s in zip(names, seconds)]
    hi = [max(ran[n]["seconds_per_repeat"]) - s for n, s in zip(names, seconds)]
    axes[0].bar(names, seconds, yerr=[lo, hi], capsize=4, color=[colours.get(n, "tab:orange") for n in names])
    axes[0].set_ylabel("seconds per epoch (median, min-max)")
    speed, _, _ = speedups(result)
    ratio = result["position_ratio"]
    axes[1].bar(list(speed), list(speed.values()), color=[colours.get(n, "tab:orange") for n in speed])
    axes[1].axhline(ratio, ls="--", color="k", lw=1, label=f"position ratio {ratio:.1f}x")
    axes[1].set_ylabel("shared-prefix speedup over")
    axes[1].legend(loc="lower right", fontsize=8)
    axes[2].bar(names, [ran[n]["peak_memory_bytes"] / MiB for n in names],
                color=[colours.get(n, "tab:orange") for n in names])
    axes[2].set_ylabel("peak memory above the models, MiB")
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    path = out_dir / "bench.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
