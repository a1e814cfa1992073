"""The memory estimate as ``plan --memory`` and a run's header print it: the terms table, the peak per phase beside
``--measure``'s count, and one line per ``packing.context_grad``; every line within :data:`WIDTH` columns (a term's
label wraps under itself, the figures stay in their column)."""

from __future__ import annotations

import textwrap

from packtrain.memory.estimate import GiB, MemoryEstimate

WIDTH = 120  # a terminal's columns: what `plan` and a run's header print fits them


def fit(line: str, indent: str | None = None, width: int = WIDTH) -> list[str]:
    """``line`` as lines of at most ``width`` columns, broken between words; the lines after the first start with
    ``indent`` (default: the line's own leading spaces and two more)."""
    if len(line) <= width:
        return [line]
    text = line.lstrip(" ")
    lead = line[:len(line) - len(text)]
    return textwrap.wrap(text, width, initial_indent=lead, subsequent_indent=lead + "  " if indent is None else indent,
                         break_on_hyphens=False, break_long_words=False)


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
        lines += [row for note in measured.notes for row in fit(f"  measured: {note}")]
    lines += fit("  savings: " + "; ".join(est.savings.describe()))
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
    """The terms, each a row of its GiB (``~``: approximate) and its label, a term's parts indented below it; the
    host's terms and the ones compared (not held) after the device's total."""
    def rows(gib: float | None, label: str, mark: str = " ", depth: int = 0) -> list[str]:
        figure = "" if gib is None else f"{gib:.2f}"
        head = f"  {figure:>8} {mark} " + "  " * depth
        return fit(head + label, " " * len(head) + "  ")

    lines = [est.title, f"  {'GiB':>8}   on each GPU"]
    for t in est.terms:
        if t.where == "device":
            lines += rows(t.bytes / GiB, t.label, "~" if t.approx else " ", t.depth)
    lines += rows(est.total("device") / GiB, "total on the device")
    host = [t for t in est.terms if t.where == "host"]
    if host:
        lines += rows(None, "in host memory (per rank)")
        for t in host:
            lines += rows(t.bytes / GiB, t.label, depth=1)
    for t in est.terms:
        if t.where == "compare":
            lines += rows(t.bytes / GiB, f"{t.label} ({t.bytes / 1e9:.1f} GB)")
    lines.append("  ~ approximate (kernel-dependent); `packtrain smoke` measures the real peak")
    return "\n".join(lines)
