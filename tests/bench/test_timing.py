"""The bench's timing (packtrain/bench/timing.py) with the variants' epochs stood in for: the interleaved order (one
memory pass from released memory, the warm-up where each device wants it, the order rotated per repeat), a variant
that runs out of memory or diverges left out of the rest, one run's time and peak memory, and the figures summarized
from the runs. The real command: tests/commands/test_bench.py."""

import statistics
from types import SimpleNamespace

import pytest
import torch

from packtrain.bench import timing
from packtrain.bench.timing import Run, VariantRuns, interleave, summarize, timed_run

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


class FakeModels:
    def __init__(self, calls, losses=None):
        self.calls, self.losses = calls, losses or {}

    def evaluate(self, v, work):
        self.calls.append(("evaluate", v))
        return self.losses.get(v, 1.5)


def _interleave(monkeypatch, device, variants, repeats, warmup, fails=(), losses=None):
    """(the calls made, in order, as (what, variant), the results). ``fails``: variants whose epoch runs out of
    memory from their second call on (the memory pass succeeds)."""
    calls, seen = [], {}

    def run_variant(v, models, work, max_steps=None):
        seen[v] = seen.get(v, 0) + 1
        calls.append(("warm-up" if max_steps == 1 else "epoch", v))
        if v in fails and seen[v] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return [2.0]

    monkeypatch.setattr(timing, "run_variant", run_variant)
    monkeypatch.setattr(timing, "release_memory", lambda device: calls.append(("release", None)))
    monkeypatch.setattr(timing, "_sync", lambda device: None)
    monkeypatch.setattr(timing, "PeakMemory", lambda device: SimpleNamespace(reset=lambda: None, read=lambda: (0, None)))
    monkeypatch.setattr(timing, "memory_in_use", lambda device: 0)
    monkeypatch.setattr(timing, "gc", SimpleNamespace(collect=lambda: None))  # a full collection per run: slow here
    logged = []
    results = interleave(FakeModels(calls, losses), SimpleNamespace(device=device), variants, repeats, warmup,
                         log=logged.append)
    return calls, results, logged


def test_repeats_rotate_the_order_after_one_memory_pass(monkeypatch):
    calls, results, _ = _interleave(monkeypatch, CPU, ["a", "b", "c"], 3, warmup=True)
    memory = [("release", None), ("epoch", "a"), ("release", None), ("epoch", "b"), ("release", None), ("epoch", "c")]
    warm = [("warm-up", "a"), ("warm-up", "b"), ("warm-up", "c")]  # on the CPU after the memory pass
    timed = [x for v in "abcbcacab" for x in (("epoch", v), ("evaluate", v))]
    assert calls == memory + warm + timed
    assert all(len(results[v].runs) == 3 and results[v].error is None for v in "abc")
    assert all(r.losses == [2.0] and r.final_loss == 1.5 for v in "abc" for r in results[v].runs)


def test_on_cuda_the_warm_up_comes_before_the_memory_pass(monkeypatch):
    calls, _, _ = _interleave(monkeypatch, CUDA, ["a", "b"], 1, warmup=True)
    assert calls[:3] == [("warm-up", "a"), ("warm-up", "b"), ("release", None)]
    calls, _, _ = _interleave(monkeypatch, CUDA, ["a", "b"], 1, warmup=False)
    assert ("warm-up", "a") not in calls


def test_a_variant_out_of_memory_is_left_out_of_the_remaining_repeats(monkeypatch):
    calls, results, logged = _interleave(monkeypatch, CPU, ["a", "b"], 3, warmup=False, fails={"b"})
    assert results["b"].error == "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert [c for c in calls if c[0] == "epoch"] == [("epoch", "a"), ("epoch", "b"), ("epoch", "a"), ("epoch", "b"),
                                                      ("epoch", "a"), ("epoch", "a")]
    assert len(results["a"].runs) == 3 and results["b"].runs == []
    assert any(line.startswith("  b: out of memory") for line in logged)


def test_an_error_other_than_out_of_memory_is_raised(monkeypatch):
    monkeypatch.setattr(timing, "run_variant", lambda *a, **k: 1 / 0)
    monkeypatch.setattr(timing, "release_memory", lambda device: None)
    with pytest.raises(ZeroDivisionError):
        interleave(FakeModels([]), SimpleNamespace(device=CPU), ["a"], 1, False, log=lambda line: None)


def test_a_diverged_variant_is_an_error_and_runs_no_more(monkeypatch):
    calls, results, _ = _interleave(monkeypatch, CPU, ["a", "b"], 2, warmup=False, losses={"a": float("nan")})
    assert results["a"].error == "diverged: the trained adapter's loss is nan" and results["a"].runs == []
    assert [c for c in calls if c[0] == "epoch"].count(("epoch", "a")) == 2  # the memory pass and repeat 1
    assert len(results["b"].runs) == 2


def test_a_run_is_timed_and_its_added_peak_memory_counted():
    def epoch():
        held = torch.ones(32 * 2**20 // 4)  # 32 MiB, touched
        assert held.sum() > 0
        return [3.0]

    run = timed_run(epoch, CPU, release=True)
    assert run.losses == [3.0] and run.seconds > 0 and run.cpu_seconds > 0
    assert run.peak_memory_bytes >= 30 * 2**20


def test_summarize_takes_the_median_and_the_rates_of_it(monkeypatch):
    monkeypatch.setattr(timing, "model_flops", lambda text, positions, pairs, rows: 1000.0 * positions)
    runs = [Run(s, 0, s / 2, [4.0, 3.0], final_loss=f) for s, f in ((4.0, 2.5), (1.0, 2.25), (2.0, 2.0))]
    results = {"a": VariantRuns(runs, peak_memory_bytes=77), "b": VariantRuns(error="out of memory: x")}
    work = {"a": (100, 400, 10), "b": (50, 60, 5)}
    out = summarize(results, work, {"positions_standalone": 300}, target_tokens=30, text={}, peak_tflops=2e-9)
    a = out["a"]
    assert a["seconds"] == statistics.median([4.0, 1.0, 2.0]) == 2.0 and a["seconds_per_repeat"] == [4.0, 1.0, 2.0]
    assert (a["cpu_seconds"], a["positions_per_s"], a["example_positions_per_s"], a["target_tokens_per_s"]) == (
        1.0, 50.0, 150.0, 15.0)
    assert (a["model_flops"], a["model_flops_per_s"], a["mfu"]) == (100_000.0, 50_000.0, pytest.approx(50_000 / 2000))
    assert (a["final_loss"], a["step_losses"], a["peak_memory_bytes"], a["error"]) == (2.0, [4.0, 3.0], 77, None)
    assert out["b"] == {"positions": 50, "attention_pairs": 60, "lm_head_rows": 5, "model_flops": 50_000.0,
                        "error": "out of memory: x"}
    assert summarize(results, work, {"positions_standalone": 300}, 30, {}, None)["a"]["mfu"] is None
