"""The memory estimate as `plan --memory` prints it (packtrain/memory/describe.py), from an estimate written by hand:
the terms table (device terms with their parts indented, the host and compared terms apart, approximate ones
marked), each phase beside the measured count, and one line per context mode."""

from types import SimpleNamespace

from packtrain.memory.describe import fit, format_modes, format_phases, format_table
from packtrain.memory.estimate import GiB, MemoryEstimate, Term


def _estimate(phases=None, checkpointed=1.0):
    terms = [Term("weights", "weights", 2 * GiB), Term("lora", "of which adapters", GiB // 2, depth=1),
             Term("checkpointed_inputs", "checkpointed inputs", int(checkpointed * GiB), approx=True),
             Term("offload", "offloaded inputs", 3 * GiB, where="host"),
             Term("full_logits", "full logits", 10**9, where="compare")]
    savings = SimpleNamespace(describe=lambda: ["checkpointing", "loss in 1024 rows"])
    return MemoryEstimate(terms, "estimate for a pack", phases or {}, savings)


def test_the_table_lists_device_terms_then_host_and_compared_ones():
    assert format_table(_estimate()).splitlines() == [
        "estimate for a pack",
        "       GiB   on each GPU",
        "      2.00   weights",
        "      0.50     of which adapters",
        "      1.00 ~ checkpointed inputs",
        "      3.00   total on the device",  # the parts of a term are not added again
        "             in host memory (per rank)",
        "      3.00     offloaded inputs",
        "      0.93   full logits (1.0 GB)",
        "  ~ approximate (kernel-dependent); `packtrain smoke` measures the real peak"]


def test_a_long_label_wraps_under_itself_and_the_figures_keep_their_column():
    """The figures come first: a label of any length wraps within 120 columns (a 27B's 500-column term put the GiB
    column off the terminal), each part of a term below its own label."""
    label = "the norm's backward in tiles of 8,192 rows: " + ", ".join(["6 x 41,943,040 float32"] * 8)
    est = MemoryEstimate([Term("w", "weights", 2 * GiB), Term("norm", label, GiB, depth=1, approx=True)], "t", {},
                         SimpleNamespace(describe=list))
    lines = format_table(est).splitlines()
    assert max(map(len, lines)) <= 120 and len(lines) > 6
    assert lines[3].startswith("      1.00 ~   the norm's backward in tiles of 8,192 rows: 6 x 41,943,040")
    assert all(line.startswith(" " * 17) and not line.startswith(" " * 18) for line in lines[4:-2])
    assert " ".join(line.strip() for line in lines[3:-2]) == f"1.00 ~   {label}"
    assert lines[-2] == "      2.00   total on the device"


def test_every_line_fits_and_a_wrapped_line_keeps_its_words():
    line = "  savings: " + "; ".join(f"saving {k}: {'x' * k}" for k in range(30))
    lines = fit(line)
    assert len(lines) > 1 and all(len(x) <= 120 for x in lines) and lines[0].startswith("  savings: saving 0")
    assert all(x.startswith("    ") for x in lines[1:]) and " ".join(x.strip() for x in lines) == line.strip()
    assert fit("short") == ["short"]


def test_each_phase_beside_the_measured_count():
    est = _estimate({"forward": 4 * GiB, "backward": 5 * GiB})
    measured = SimpleNamespace(phases={"backward": 6 * GiB, "optimizer": GiB}, peak=6 * GiB, host=GiB // 4,
                               notes=["fake tensors"])
    assert format_phases(est, measured).splitlines() == [
        "peak per phase (GiB on each GPU; the peak is the largest phase, not a sum)",
        "  phase                             estimate  measured",
        "  forward                               4.00          ",
        "  backward                              5.00      6.00",
        "  optimizer                                       1.00",
        "  peak                                  5.00      6.00",
        "  host (checkpointed inputs)            3.00      0.25",
        "  measured: fake tensors",
        "  savings: checkpointing; loss in 1024 rows"]
    assert format_phases(est).splitlines()[1:4] == [
        "  phase                             estimate", "  forward                               4.00",
        "  backward                              5.00"]


def test_one_line_per_context_mode():
    lines = format_modes({"full": _estimate({"backward": 5 * GiB}), "frozen": _estimate({"backward": GiB}, 0.25)})
    assert lines.splitlines()[2:] == ["  full              5.00          1.00             0.00     0.00",
                                      "  frozen            1.00          0.25             0.00     0.00"]
