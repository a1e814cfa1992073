"""What `packtrain bench` reports (packtrain/bench/report.py), from a result worked by hand: each variant's time
against shared_prefix's and against the position ratio on the wall and CPU clocks (figures, no goals), the dpo
preset's tree against standalone pairs, and bench.json never holding a NaN."""

import json
import math

import pytest

from packtrain.bench.report import format_table, speedups, versus, write_json


def _variant(seconds, positions, final_loss, cpu=None, mfu=None):
    return {"seconds": seconds, "cpu_seconds": seconds if cpu is None else cpu, "positions": positions,
            "final_loss": final_loss, "positions_per_s": positions / seconds, "target_tokens_per_s": 10.0,
            "peak_memory_bytes": 3 * 2**20, "mfu": mfu, "seconds_per_repeat": [seconds]}


def _result(cuda=False, preset="cpu"):
    return {
        "title": "bench", "preset": preset, "model": {"describe": "tiny"}, "repeats": 3, "warmup": True,
        "machine": {"device": "cpu", "torch": "x", "transformers": "y", "cuda": cuda, "load_before": 0.5,
                    "load_after": 0.75},
        "plan": {"examples": 8, "packs": 1, "positions_standalone": 1000, "positions_packed": 100},
        "steps_per_epoch": 1, "position_ratio": 10.0, "peak_tflops": None,
        "variants": {
            "shared_prefix": _variant(2.0, 100, 1.0, cpu=1.0),
            "kv_only": _variant(1.5, 100, 1.25),  # the same positions: no "of ratio"
            "standalone": _variant(19.0, 1000, 1.1, cpu=9.5, mfu=0.125),  # 9.5x faster at a ratio of 10
            "tree": _variant(0.8, 50, 1.0, cpu=0.25),  # 2.5x faster on half the positions
            "plain": {"positions": 1000, "error": "out of memory: x"},
        },
    }


def test_speedups_are_against_shared_prefix_and_the_position_ratio():
    speed, of_ratio, loss_diff = speedups(_result())
    assert speed == {"kv_only": 0.75, "standalone": 9.5, "tree": 0.4}
    assert of_ratio == {"standalone": pytest.approx(9.5 / 10), "tree": pytest.approx(2.5 / 2)}
    assert loss_diff == pytest.approx({"kv_only": 0.25 / 1.25, "standalone": 0.1 / 1.1, "tree": 0.0})
    speed, of_ratio, _ = speedups(_result(), "cpu_seconds")
    assert speed["standalone"] == 9.5 and of_ratio["tree"] == pytest.approx(4.0 / 2)


def test_versus_needs_both_variants():
    assert versus(_result(), "tree", "standalone") == pytest.approx(
        {"speedup": 19.0 / 0.8, "position_ratio": 20.0, "of_ratio": 19.0 / 0.8 / 20})
    assert versus(_result(), "tree", "plain") is None


def test_the_table_gives_the_figures_and_ratios_on_each_clock_and_no_goal():
    """The figures and ratios, never a verdict on them: the bench printed its own goals ("NOT met: >= 0.9") as if
    they were the user's."""
    table = format_table(_result())
    assert "  plain         out of memory: x" in table.splitlines()
    assert "  of ratio (CPU time): 0.95 vs standalone; 2.00 vs tree" in table.splitlines()  # wall: the table's column
    standalone = next(line for line in table.splitlines() if line.startswith("  standalone"))
    assert standalone.split() == ["standalone", "19.00", "9.50x", "0.95", "53", "10", "3", "1.100000", "12.5%"]
    result = _result(cuda=True, preset="dpo")
    result["variants"]["standalone"]["seconds"] = 14.0  # 7x faster at a ratio of 10: 0.70
    table = format_table(result)
    assert "CPU time" not in table  # CUDA runs asynchronously
    standalone = next(line for line in table.splitlines() if line.startswith("  standalone"))
    assert standalone.split()[:4] == ["standalone", "14.00", "7.00x", "0.70"]
    assert ("  tree vs standalone pairs (wall): 17.50x faster, position ratio 20.00x: 0.88 of the ratio"
            in table.splitlines())
    for words in ("goal", "met", ">="):
        assert words not in table, words


def test_bench_json_never_holds_a_nan(tmp_path):
    result = _result()
    assert json.loads(write_json(result, tmp_path).read_text()) == result
    result["variants"]["tree"]["final_loss"] = math.nan
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        write_json(result, tmp_path)
