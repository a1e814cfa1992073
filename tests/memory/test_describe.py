"""The memory estimate as `plan --memory` prints it (packtrain/memory/describe.py), from an estimate written by hand:
the terms table (device terms with their parts indented, the host and compared terms apart, approximate ones
marked), each phase beside the measured count, and one line per context mode."""

from types import SimpleNamespace

from packtrain.memory.describe import format_modes, format_phases, format_table
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
        "  on each GPU                 GiB",
        "  weights                    2.00  ",
        "    of which adapters        0.50  ",
        "  checkpointed inputs        1.00 ~",
        "  total on the device        3.00",  # the parts of a term are not added again
        "  in host memory (per rank)",
        "  offloaded inputs           3.00",
        "  full logits                0.93  (1.0 GB)",
        "  ~ approximate (kernel-dependent); `packtrain smoke` measures the real peak"]


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
