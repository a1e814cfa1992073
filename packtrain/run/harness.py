"""One optimizer update on one chosen unit, through the unit runner as the trainer runs it: for ``packtrain smoke``
(the largest unit, memory per phase) and ``packtrain pretune-fla`` (a shortened prompt, so Triton tunes with memory
to spare). Also the per-phase peak-memory probe.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from packtrain.data.planner import Plan
from packtrain.models import memory
from packtrain.run.steps import Unit
from packtrain.run.units import Prepared, UnitSetup, prepare, run_unit, step_scale


def build_lm(cfg, info):
    """(PackedLM on the device, the peft model, the back end), wrapped as the trainer wraps it (FSDP under a
    launcher)."""
    from packtrain.models.build import build_base_model
    from packtrain.models.wrap import prepare_from_config

    model, lm, backend = prepare_from_config(build_base_model(cfg, meta=True), cfg, info.device, shard=info.enabled)
    return lm, model, backend


def largest_unit(plan: Plan, examples, mode: str, max_positions: int | None = None) -> Unit:
    """The unit with the most positions (:func:`packtrain.models.memory.largest_unit`); a walked example keeps its
    schedule, so it is walked as training walks it."""
    prompt, ids = memory.largest_unit(plan, examples, mode, max_positions)
    walked = next((p.schedule for p in plan.packs if p.schedule is not None and p.examples == tuple(ids)), None)
    return Unit(prompt, tuple(ids), schedule=walked)


def prepare_shortened(unit: Unit, plan: Plan, examples, setup: UnitSetup, prompt_tokens: int | None) -> Prepared:
    """The unit prepared with P cut to its first ``prompt_tokens`` tokens (None: as planned)."""
    if prompt_tokens is not None:
        plan = dataclasses.replace(plan, prompts=[p[:prompt_tokens] for p in plan.prompts])
    return prepare(unit, plan, examples, setup)


def one_update(lm, prepared: Prepared, setup: UnitSetup, optimizer, device) -> float:
    """Forward, backward (through :func:`packtrain.run.units.run_unit`) and optimizer step on one unit, scaled as
    the trainer scales a step that is this unit on every rank. Returns the unit's mean per-example loss."""
    n = len(prepared.unit.examples)
    result = run_unit(lm, prepared, setup, device, step_scale(n))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return result.loss_sum / n


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))  # CPU allocator


class PeakMemory:
    """Peak memory since the last ``reset``. CUDA: allocated and reserved by the caching allocator. CPU: the
    process's peak resident set (VmHWM, reset through /proc/self/clear_refs; where that is not allowed the peak
    is the process's since it started)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.since_start = False

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            self.since_start = True

    def read(self) -> tuple[int, int | None]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
        status = Path("/proc/self/status")
        if status.exists():
            m = re.search(r"VmHWM:\s+(\d+) kB", status.read_text())
            if m:
                return int(m.group(1)) * 1024, None
        from packtrain.run.metrics import peak_memory_bytes

        self.since_start = True
        return peak_memory_bytes(self.device), None


@dataclass
class Phase:
    name: str
    allocated: int | None = None
    reserved: int | None = None
    seconds: float = 0.0
    error: str | None = None


def run_phase(phases: list[Phase], probe: PeakMemory, name: str, fn):
    """Run ``fn`` as one measured phase; an out-of-memory error is recorded on the phase and re-raised."""
    phase = Phase(name)
    phases.append(phase)
    probe.reset()
    t0 = time.perf_counter()
    try:
        return fn()
    except BaseException as e:
        if is_out_of_memory(e):
            phase.error = f"out of memory: {str(e).splitlines()[0][:200]}"
        raise
    finally:
        phase.seconds = time.perf_counter() - t0
        phase.allocated, phase.reserved = probe.read()
