"""Interleaved timing, per-run peak memory, and model FLOPs.

Runs are interleaved: every repeat runs each variant once (the order rotated per repeat, so none always runs
first or after the same neighbour), and a variant's time is the median over repeats. Each run is a whole
epoch-equivalent from the same initial adapter; the evaluation of what it trained is not timed.

Peak memory is measured in a pass of its own before the timed repeats: one untimed run of every variant. CPU: the
peak resident set during the run above the resident set just before it, after freeing what the previous run left
(gc, then glibc's ``malloc_trim``), with the kernel's peak counter reset in between (``/proc/self/clear_refs``).
CUDA: peak allocated during the run above what was allocated before it. Either way it is what the run adds on top
of the loaded models: activations, gradients, optimizer state, logits.

The timed repeats run on a warm allocator, as every step of a training run after its first does: handing the heap
back to the kernel before a run makes the run fault its memory in again page by page, and that cost is not spread
evenly: a pack's epoch pays it in full, a standalone epoch once, since its examples reuse one example's memory. So
on the CPU the warm-up (one untimed step of every variant, the cpu and tiny presets' default) runs after the memory
pass, which released the heap before each of its runs, and the heap is kept from then on
(``loading.keep_heap_between_steps``, as in training). Without it the first timed repeat's first variant grows the
heap from the last memory run's size to its own and reads slow. The figures: docs/performance.md, "How bench times
now".

Model FLOPs of an epoch, per variant, for the positions that variant computes (no recompute): the cost model's
(:mod:`packtrain.models.cost`, the one count the balance and the savings use: 6 per parameter a token meets, 12 per
attention pair and width, 6 per head row and width x vocabulary) over the positions, the causal query-key pairs and
the lm_head rows it computes (target positions for packtrain, every position for the plain loop). ``kv_only`` and
``frozen`` are counted as ``shared_prefix`` (the full-gradient work of the same pack), so their MFU reads as
full-equivalent throughput and their gain shows as time. Left out: the Gated DeltaNet chunk recurrence and conv
(about 1.4% of a GDN layer at Qwen3.6-27B's shapes), norms and elementwise work.
"""

from __future__ import annotations

import ctypes
import gc
import math
import re
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from packtrain.bench.variants import Models, Workload, run_variant
from packtrain.models.cost import CostModel
from packtrain.run.harness import PeakMemory, is_out_of_memory


@dataclass
class Run:
    seconds: float
    peak_memory_bytes: int
    cpu_seconds: float  # this process's CPU time: on a shared machine, one thread, less moved by others' load
    losses: list[float]  # each step's mean per-example training loss
    final_loss: float | None = None  # the trained adapter's mean per-example loss (Models.evaluate)


@dataclass
class VariantRuns:
    runs: list[Run] = field(default_factory=list)
    error: str | None = None
    peak_memory_bytes: int = 0  # from the memory pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Free what the last run left: a garbage collection, then CUDA's cached blocks or glibc's free heap pages."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:  # hand freed heap pages back, so the next run's peak is not hidden in memory the last one left
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def memory_in_use(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    m = re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(m.group(1)) * 1024


def timed_run(fn, device: torch.device, release: bool = False) -> Run:
    """One run of ``fn``: its time and the peak memory it added. ``release``: hand freed memory back first (the
    memory pass); otherwise only collect garbage (the timed repeats, on a warm allocator)."""
    if release:
        release_memory(device)
    else:
        gc.collect()
    _sync(device)
    probe = PeakMemory(device)
    probe.reset()
    before = memory_in_use(device)
    t0, c0 = time.perf_counter(), time.process_time()
    losses = fn()
    _sync(device)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak, _ = probe.read()
    return Run(seconds, max(peak - before, 0), cpu_seconds, losses)


def interleave(models: Models, work: Workload, variants: list[str], repeats: int, warmup: bool,
               log=print) -> dict[str, VariantRuns]:
    results = {v: VariantRuns() for v in variants}

    def attempt(v: str, fn):
        try:
            return fn()
        except BaseException as e:
            if not is_out_of_memory(e):
                raise
            results[v].error = f"out of memory: {str(e).splitlines()[0][:200]}"
            log(f"  {v}: {results[v].error}; left out of the remaining repeats")
            release_memory(work.device)

    def warm_up():
        for v in variants:
            t0 = time.perf_counter()
            attempt(v, partial(run_variant, v, models, work, max_steps=1))
            log(f"  warm-up {v}: one step, {time.perf_counter() - t0:.1f} s (not timed)")

    # The warm-up: on CUDA before the memory pass (compilation and autotuning stay out of it); on the CPU after it,
    # whose releases hand the heap back: otherwise the first timed run grows the heap again page by page, as
    # only a training run's first step does
    if warmup and work.device.type != "cpu":
        warm_up()
    for v in variants:  # the memory pass: each variant once from released memory, not timed
        run = attempt(v, partial(timed_run, partial(run_variant, v, models, work), work.device, release=True))
        if run is not None:
            results[v].peak_memory_bytes = run.peak_memory_bytes
            log(f"  memory {v:<13} {run.peak_memory_bytes / 2**20:8,.0f} MiB above the models (not timed)")
    if warmup and work.device.type == "cpu":
        warm_up()
    for r in range(repeats):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            if results[v].error:
                continue
            run = attempt(v, partial(timed_run, partial(run_variant, v, models, work), work.device))
            if run is not None:
                run.final_loss = models.evaluate(v, work)
                if not math.isfinite(run.final_loss):  # bench.json holds finite numbers: a diverged run is an error
                    results[v].error = f"diverged: the trained adapter's loss is {run.final_loss!r}"
                    log(f"  {v}: {results[v].error}; left out of the remaining repeats")
                    continue
                results[v].runs.append(run)
                log(f"  repeat {r + 1}/{repeats} {v:<13} {run.seconds:8.2f} s ({run.cpu_seconds:.2f} s CPU)   "
                    f"final loss {run.final_loss:.7f}")
    return results


def model_flops(text: dict, positions: int, pairs: int, head_rows: int) -> float:
    """Forward + backward model FLOPs of a variant's epoch: the cost model's (:mod:`packtrain.models.cost`, the one
    count the balance and the savings use), for a text config dict (models.text_config.text_config)."""
    return CostModel.of_text(text).flops(positions, pairs, head_rows)


def summarize(results: dict[str, VariantRuns], work: dict[str, tuple[int, int, int]], stats: dict,
              target_tokens: int, text: dict, peak_tflops: float | None) -> dict:
    """Each variant's figures; ``work``: the (positions, attention pairs, lm_head rows) of its epoch
    (:meth:`packtrain.bench.variants.PackedVariant.figures`), ``stats`` the config's plan's."""
    out = {}
    for v, vr in results.items():
        positions, pairs, head_rows = work[v]
        entry = {"positions": positions, "attention_pairs": pairs, "lm_head_rows": head_rows,
                 "model_flops": model_flops(text, positions, pairs, head_rows),
                 "error": vr.error}
        if vr.runs:
            seconds = statistics.median(r.seconds for r in vr.runs)
            flops_per_s = entry["model_flops"] / seconds
            entry.update({
                "seconds": seconds,
                "seconds_per_repeat": [r.seconds for r in vr.runs],
                "cpu_seconds": statistics.median(r.cpu_seconds for r in vr.runs),
                "positions_per_s": positions / seconds,
                "example_positions_per_s": stats["positions_standalone"] / seconds,
                "target_tokens_per_s": target_tokens / seconds,
                "peak_memory_bytes": vr.peak_memory_bytes,
                "final_loss": vr.runs[-1].final_loss,
                "step_losses": vr.runs[-1].losses,
                "model_flops_per_s": flops_per_s,
                "mfu": flops_per_s / (peak_tflops * 1e12) if peak_tflops else None,
            })
        out[v] = entry
    return out
