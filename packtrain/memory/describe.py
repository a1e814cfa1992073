"""The memory estimate as ``plan --memory`` and a run's header print it: the terms table, the peak per phase beside
``--measure``'s count, and one line per ``packing.context_grad``."""

from __future__ import annotations

from packtrain.memory.estimate import GiB, MemoryEstimate


def format_phases(est: MemoryEstimate, measured=None) -> str:
    """Each phase's device peak: the estimate, and with ``measured`` (``plan --measure``) the counted step."""
    lines = ["peak per phase (GiB on each GPU; the peak is the largest phase, not a sum)",
             f"  {'phase':<32}{'estimate':>10}" + (f"{'measured':>10}" if measured is not None else "")]
    names = list(est.phases) + [p for p in (measured.phases if measured else {}) if p not in est.phases]
    for name in names:
        e = est.phases.get(name)
        row = f"  {name:<32}{'' if e is None else f'{e / GiB:.2f}':>10}"
        if measured is not None:
            m = measured.phases.get(name)
            row += f"{'' if m is None else f'{m / GiB:.2f}':>10}"
        lines.append(row)
    lines.append(f"  {'peak':<32}{est.total() / GiB:>10.2f}" + (f"{measured.peak / GiB:>10.2f}" if measured else ""))
    if measured is not None:
        lines.append(f"  {'host (checkpointed inputs)':<32}{est.total('host') / GiB:>10.2f}{measured.host / GiB:>10.2f}")
        lines += [f"  measured: {note}" for note in measured.notes]
    lines.append("  savings: " + "; ".join(est.savings.describe()))
    return "\n".join(lines)


def format_modes(estimates: dict[str, MemoryEstimate]) -> str:
    """One line per ``packing.context_grad``: the device total and the terms that change between modes."""
    def gib(est: MemoryEstimate, key: str) -> float:
        return next((t.bytes for t in est.terms if t.key == key), 0) / GiB

    lines = ["each packing.context_grad on this pack (GiB on each GPU; kv_only saves backward time, not memory)",
             f"  {'context_grad':<14}{'total':>8}{'checkpointed':>14}{'layer recompute':>17}{'P cache':>9}"]
    for mode, est in estimates.items():
        lines.append(f"  {mode:<14}{est.total('device') / GiB:>8.2f}{gib(est, 'checkpointed_inputs'):>14.2f}"
                     f"{gib(est, 'layer_peak'):>17.2f}{gib(est, 'prefix_cache'):>9.2f}")
    return "\n".join(lines)


def format_table(est: MemoryEstimate) -> str:
    def gib(n: int) -> str:
        return f"{n / GiB:8.2f}"

    width = max(len(t.label) + 2 * t.depth for t in est.terms) + 4
    lines = [est.title, f"  {'on each GPU':<{width}}{'GiB':>8}"]
    for t in est.terms:
        if t.where == "device":
            mark = "~" if t.approx else " "
            lines.append(f"  {'  ' * t.depth}{t.label:<{width - 2 * t.depth}}{gib(t.bytes)} {mark}")
    lines.append(f"  {'total on the device':<{width}}{gib(est.total('device'))}")
    host = [t for t in est.terms if t.where == "host"]
    if host:
        lines.append(f"  {'in host memory (per rank)':<{width}}")
        lines += [f"  {t.label:<{width}}{gib(t.bytes)}" for t in host]
    for t in est.terms:
        if t.where == "compare":
            lines.append(f"  {t.label:<{width}}{gib(t.bytes)}  ({t.bytes / 1e9:.1f} GB)")
    lines.append("  ~ approximate (kernel-dependent); `packtrain smoke` measures the real peak")
    return "\n".join(lines)
