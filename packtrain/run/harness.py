"""One optimizer update on one pack, through the trainer's step (:meth:`packtrain.run.step.Step.run`, its build, its
skip agreement, its padding): for ``packtrain smoke`` (the plan's largest unit, memory per phase), ``packtrain
pretune-fla`` (a shortened prompt, so Triton tunes with memory to spare) and ``plan --measure``. Also the per-phase
peak-memory probe.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from packtrain.data.attention_pairs import causal_pairs, tree_pairs
from packtrain.data.planner import Plan
from packtrain.distributed import DistInfo
from packtrain.run.optim import build_optimizer, build_scheduler
from packtrain.run.step import Step
from packtrain.run.units import Kinds, Unit, largest_unit


def one_pack(plan: Plan, examples, kinds: Kinds, max_positions: int | None = None,
             prompt_tokens: int | None = None) -> tuple[Plan, Unit]:
    """A plan of one pack: the plan's largest unit (:func:`packtrain.run.units.largest_unit`) as a pack of its own
    (a pack's one unit is the pack; an example alone, the pack of that example), with P cut to its first
    ``prompt_tokens`` tokens (None: as planned). Returns (the plan, its one unit)."""
    unit = largest_unit(plan, examples, kinds, max_positions)
    pack = next(p for p in plan.packs if p.prompt == unit.prompt and set(unit.examples) <= set(p.examples))
    p = len(plan.prompts[unit.prompt])
    prompt = plan.prompts[unit.prompt][:prompt_tokens]  # [:None]: all of it
    after = unit.kind.positions(unit, plan, examples) - p  # the unit's positions after P
    if pack.examples != unit.examples:  # several units in a pack (examples alone): the largest one's examples
        own = sum(causal_pairs(examples[e].len_continuation) for e in unit.examples)
    else:  # a pack's (or a tree's) pairs past P's keys
        own = pack.attention_pairs - causal_pairs(p) - p * after
    pack = dataclasses.replace(pack, prompt=0, examples=unit.examples, positions=len(prompt) + after,
                               attention_pairs=tree_pairs(len(prompt), after, own))
    one = dataclasses.replace(plan, packs=[pack], prompts=[prompt], skipped=[])
    (unit,) = kinds.units(pack)
    return one, unit


def update_step(cfg, lm, kinds: Kinds, plan: Plan, examples, info: DistInfo, steps: int = 2) -> Step:
    """The trainer's step on ``plan`` (a one-pack plan, :func:`one_pack`) over ``lm``'s trainable parameters, with
    a fresh optimizer and an LR schedule of ``steps``."""
    params = [p for p in lm.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.optim)
    return Step(lm, kinds, plan, examples, info, params, optimizer, build_scheduler(optimizer, cfg.optim, steps),
                cfg.optim.max_grad_norm, cfg.train.max_positions)


def on_every_rank(step: Step) -> list[int]:
    """The step's pack ids that give every rank the plan's one pack, whole (rank r runs ids r, r + world, ...)."""
    return [0] * step.info.world_size


def one_update(step: Step, number: int = 0) -> float:
    """Optimizer step ``number`` on the one pack of ``step.plan`` on every rank, as the trainer steps a step that is
    this pack on every rank. Returns its mean per-example loss."""
    return step.run(on_every_rank(step), number).loss


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


def measure_step(cfg, plan, examples, kinds=None):
    """``plan --memory --measure``: one update of the plan's largest unit through the trainer's step (a one-pack plan,
    :func:`one_pack`) on the reduced model under fake tensors, its live bytes counted per phase
    (:func:`packtrain.memory.measure.count_update`; ``kinds``: the run's, else the config's). Returns the count
    (:class:`~packtrain.memory.measure.Measured`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from packtrain.memory import measure
    from packtrain.run.session import open_session

    examples, notes = measure.text_only(examples)
    one_rank = DistInfo(0, 1, 0, torch.device("cpu"))
    # the run's setup on the reduced model (one layer of each kind): the same kinds, the plan's largest unit
    session = open_session(measure.reduced_cfg(cfg), one_rank, examples=examples, plan=plan, savings=False)
    kinds = kinds or session.kinds
    one, _ = one_pack(plan, examples, kinds, cfg.train.max_positions)
    with measure.fake_tensors():
        session.build_model(meta=False, backend=measure.measure_backend(cfg), device="cpu")
        step = update_step(cfg, session.lm, kinds, one, examples, one_rank)
        with unset_fake_temporarily():
            ready = step.prepare(on_every_rank(step))  # real index tensors, built outside the fake mode
        return measure.count_update(cfg, session.model, session.lm, step, ready, notes)
