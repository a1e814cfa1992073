"""One optimizer step, the same for ``packtrain train``, ``packtrain bench`` and the harness (smoke, pretune-fla).

    the step's packs (packtrain.run.balance.StepPlan) -> this rank's units (:func:`rank_units`) -> build, agree
    on skips -> run each unit (packtrain.run.units) -> sum over ranks -> clip -> agree on finiteness -> update

Rank r takes packs r, r+world, ... of the step's list and makes their units (:meth:`packtrain.run.units.Kinds.units`,
which stamps each unit's kind), padded by the equal-call rule (:func:`packtrain.run.units.pad_units`): every rank
issues the same sequence of calls. Each rank runs its packs first, then its walks.

Each unit's ``loss_sum`` is scaled by 1 / (examples in the whole step, all ranks: the objective's measure of them,
its pairs under dpo, its tokens under grpo's dapo) and FSDP sums the ranks' gradients, so the update is the mean of
per-example losses whatever the split into packs, units or ranks (:func:`packtrain.run.units.step_scale`). Skips
(``train.max_positions``, ``train.skippable_errors``) are decided per
unit and agreed before any collective of the step (:func:`packtrain.distributed.agree`), so every rank skips the
same units; a skipped unit's examples leave the step's count.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from packtrain import faults
from packtrain.data.planner import Plan
from packtrain.distributed import DistInfo, agree, all_reduce_sum
from packtrain.packed.loss import CUT_OFF, ZeroGradientError
from packtrain.run.units import Built, Kinds, Unit, build, over_cap, pad_units, run_unit, step_scale


def step_examples(plan: Plan, pack_ids: list[int]) -> int:
    """The examples of the step made of ``pack_ids``, all ranks."""
    return sum(len(plan.packs[i].examples) for i in pack_ids)


def rank_units(plan: Plan, pack_ids: list[int], kinds: Kinds, rank: int, world: int) -> list[Unit]:
    """``rank``'s units of the step made of ``pack_ids``: its packs, then its walks, under the equal-call rule."""
    per_rank = [[u for i in pack_ids[r::world] for u in kinds.units(plan.packs[i])] for r in range(world)]
    return pad_units(per_rank, rank, kinds)


OK, SKIP, FATAL = 0, 1, 2  # per-unit codes, agreed across ranks (the largest wins)


@dataclass
class StepResult:
    """What a step did, agreed by every rank: updated, or no update for a non-finite loss or gradient norm
    (``nonfinite``: ``loss`` and ``grad_norm`` hold what they were), and whether a rank was signalled (``stop``:
    every rank stops after this step)."""
    loss: float | None  # the mean per-example loss (None: every example skipped)
    grad_norm: float | None
    lr: float
    examples: int  # the step's examples, all ranks, without the skipped ones
    positions: int  # positions computed, all ranks
    skipped: int  # this rank's skipped units
    skipped_examples: int  # all ranks
    nonfinite: bool
    stop: bool = False
    seconds: float = 0.0
    gradients_checked: bool = False  # the check that the loss reaches the adapters ran (and passed) in this step
    figures: dict = field(default_factory=dict)  # the objective's own (Objective.step_figures), all ranks

    @property
    def updated(self) -> bool:
        return self.examples > 0 and not self.nonfinite


@dataclass
class Prepared:
    """A step's units on this rank, built, and the skips every rank agreed on (:meth:`Step.prepare`)."""
    built: list[Built | None]
    skip: list[bool]
    examples: int  # the step's examples, all ranks, without the skipped ones
    skipped_examples: int  # all ranks
    started: float  # time.perf_counter() as the step began
    weighted: bool = True  # an example of the step can have a gradient (all weights 0: none, rightly)
    measure: float = 0.0  # what the step's mean is over (Objective.measure), all ranks, without the skipped ones
    data_figures: dict = field(default_factory=dict)  # the objective's figures of the step's examples


@dataclass
class Step:
    """What a step runs with. ``signals``: the process's stop signals (:mod:`packtrain.run.signals`), read at the
    step's boundary and agreed with the non-finite verdict in its one all-reduce before the update; the step returns
    both verdicts (:class:`StepResult`), and the caller acts on them."""
    lm: torch.nn.Module
    kinds: Kinds
    plan: object
    examples: list
    info: DistInfo
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: object
    max_grad_norm: float | None = None
    max_positions: int | None = None
    skippable: tuple[type[BaseException], ...] = ()
    signals: object | None = None  # StopSignals: ``requested`` set by a handler

    def __post_init__(self):
        self._nan_at, self._sigterm_at = faults.in_steps(self.info.rank)  # the tests' injected faults, read once

    def run(self, pack_ids: list[int], number: int, check_gradients: bool = False) -> StepResult:
        """Step ``number`` (0-based: the optimizer steps done before it) on the packs ``pack_ids``."""
        return self.update(self.prepare(pack_ids), number, check_gradients)

    def prepare(self, pack_ids: list[int]) -> Prepared:
        """What a step does before the model runs: this rank's units of the packs ``pack_ids`` (padded by the
        equal-call rule), built, and the skips agreed with every rank. (``plan --measure`` builds them outside its
        fake-tensor mode, then :meth:`update` runs under it.)"""
        t0 = time.perf_counter()
        units = rank_units(self.plan, pack_ids, self.kinds, self.info.rank, self.info.world_size)
        built, skip, skipped_examples, skipped_measure = self._build(units)
        n_examples = step_examples(self.plan, pack_ids) - skipped_examples
        step = [self.examples[e] for i in pack_ids for e in self.plan.packs[i].examples]
        weighted = any(map(self.kinds.objective.moves, step))
        measure = self.kinds.objective.measure(step) - skipped_measure
        return Prepared(built, skip, n_examples, skipped_examples, t0, weighted, measure,
                        self.kinds.objective.data_figures(step))

    def update(self, ready: Prepared, number: int, check_gradients: bool = False) -> StepResult:
        """Forward and backward of the prepared units, then clip, agree on finiteness and update."""
        totals = self._run_units(ready.built, ready.skip, ready.examples, ready.measure, number)
        # a step whose examples all weigh 0 has no gradient, rightly: the check waits for one that has
        result = self._finish(totals, ready.examples, ready.measure, number, check_gradients and ready.weighted,
                              sum(ready.skip), ready.skipped_examples, ready.started)
        result.figures = {**ready.data_figures, **self.kinds.objective.step_figures(totals[2:].tolist())}
        return result

    def _build(self, units: list[Unit]) -> tuple[list, list[bool], int, float]:
        """Build every unit and agree with all ranks, before any collective of the step, which units to skip.
        Returns (built units, skip flags, examples skipped across all ranks, their measure)."""
        codes, built, errors = [], [], []
        for unit in units:
            code, ready = OK, None
            try:
                ready = build(unit, self.plan, self.examples, self.kinds)
                if over_cap(ready, self.max_positions):
                    code = SKIP
            except self.skippable:
                code = SKIP
            except Exception as e:  # noqa: BLE001 - reported below, after every rank knows
                code, errors = FATAL, errors + [e]
            codes.append(code)
            built.append(ready)
        agreed = agree(codes, self.info)
        if max(agreed, default=OK) == FATAL:
            if errors:
                raise errors[0]
            raise RuntimeError("another rank failed while preparing this step (its error is in its log)")
        skip = [c == SKIP for c in agreed]
        gone = [self.examples[e] for u, s in zip(units, skip) if s for e in u.real_examples]
        mine = torch.tensor([len(gone), self.kinds.objective.measure(gone)], dtype=torch.float64,
                            device=self.info.device)
        skipped, measure = all_reduce_sum(mine, self.info).tolist()
        return built, skip, int(skipped), measure

    def _run_units(self, built: list, skip: list[bool], n_examples: int, measure: float, number: int
                   ) -> torch.Tensor:
        """Forward and backward of this rank's units; returns [sum of per-example losses, positions, the objective's
        tallies (Objective.tally)] over every rank."""
        info = self.info
        objective = self.kinds.objective
        objective.tally()  # whatever an earlier pass left (a reference table's, an evaluation's) is not this step's
        totals = torch.zeros(2, dtype=torch.float64, device=info.device)
        if n_examples > 0:
            scale = step_scale(measure)
            if self._nan_at == number + 1:
                scale = math.nan
            for ready, skipped in zip(built, skip):
                if not skipped:
                    r = run_unit(self.lm, ready, self.kinds, info.device, scale)
                    totals += torch.tensor([r.loss_sum, r.positions], dtype=torch.float64, device=info.device)
        totals = torch.cat([totals, torch.tensor(objective.tally(), dtype=torch.float64, device=info.device)])
        all_reduce_sum(totals, info)
        return totals

    def _finish(self, totals: torch.Tensor, n_examples: int, measure: float, number: int, check_gradients: bool,
                skipped: int, skipped_examples: int, t0: float) -> StepResult:
        """Clip, agree on finiteness, step the optimizer (or skip the update), step the schedule."""
        grad_norm, lr = 0.0, self.scheduler.get_last_lr()[0]
        loss = float(totals[0]) / measure if n_examples else None
        if n_examples > 0:
            max_norm = self.max_grad_norm if self.max_grad_norm is not None else math.inf
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if self._sigterm_at == number + 1:
            faults.sigterm()
        verdict = n_examples > 0 and not (math.isfinite(loss) and math.isfinite(grad_norm))
        signalled = self.signals is not None and self.signals.requested
        # the step's one agreement: the non-finite verdict and the stop signals, every rank alike
        nonfinite, stop = (bool(v) for v in agree([int(verdict), int(signalled)], self.info))
        checked = False
        if not nonfinite and n_examples > 0:  # a non-finite step makes no update: the caller skips it or stops
            if check_gradients and grad_norm == 0.0:
                raise ZeroGradientError(CUT_OFF + " (every trainable gradient is zero after the first step with "
                                        "a weight other than 0)")
            checked = check_gradients
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, grad_norm, lr, n_examples, int(totals[1]), skipped, skipped_examples, nonfinite,
                          stop, time.perf_counter() - t0, checked)
