"""What each rank computes in each optimizer step, derived from the plan alone (so every rank agrees).

A step takes ``train.packs_per_step`` packs (global, across ranks): under ``train.balance: cost`` (the default)
packs of similar cost, spread over the ranks evenly by cost (:mod:`packtrain.run.balance`); under ``round_robin``
the next packs of the epoch's seeded order. Rank r takes packs r, r+world, ... of the step's list. A *unit* is one forward/backward (:mod:`packtrain.run.units` runs it): a whole
pack in shared-prefix mode, one example in standalone mode (so both modes see the same examples per update), and a
walked example (``packing.on_overflow: walk``) is a unit of its own in both modes. Each rank runs its packs first,
then its walks.

The equal-call rule (:func:`equal_slots`): FSDP's collectives deadlock when one rank makes fewer calls than another,
so every rank issues the same sequence of calls. Slot k of a step's packs, and slot k of its walks, runs on every
rank: a rank with no unit for a slot runs a dummy (a real input, its loss scaled by zero), and every walk in slot k
runs the largest schedule any rank has there (dummy chunks). Continuation groups follow the same rule inside a pack:
every pack runs ``packing.continuation_groups`` groups, filling the last ones with dummy groups
(:mod:`packtrain.packed.groups`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from packtrain.data.planner import Plan
from packtrain.data.walk_schedule import Schedule
from packtrain.run.balance import epoch_schedule, step_pack_ids


@dataclass(frozen=True)
class Unit:
    prompt: int
    examples: tuple[int, ...]
    dummy: bool = False
    schedule: Schedule | None = None  # a walked example: the calls every rank issues in its slot


def steps_per_epoch(plan: Plan, packs_per_step: int) -> int:
    return math.ceil(len(plan.packs) / packs_per_step)


def step_packs(plan: Plan, epoch: int, index: int, packs_per_step: int, seed: int) -> list[int]:
    """Round robin: step ``index`` of epoch ``epoch`` as the next packs of the epoch's seeded order."""
    return epoch_schedule(plan, [], epoch, seed, packs_per_step, 1, "round_robin")[index][0]


class StepPlan:
    """The packs of every step of a run under ``train.balance``; each epoch's schedule is computed once."""

    def __init__(self, plan: Plan, costs: list[float], packs_per_step: int, seed: int, world: int,
                 balance: str = "cost"):
        self.plan, self.costs, self.per_step, self.seed, self.world, self.balance = (
            plan, costs, packs_per_step, seed, world, balance)
        self.steps_per_epoch = steps_per_epoch(plan, packs_per_step)
        self._epoch: tuple[int, list] | None = None

    def schedule(self, epoch: int) -> list[list[list[int]]]:
        """Epoch ``epoch``'s steps, each a list over ranks of pack indices."""
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_schedule(self.plan, self.costs, epoch, self.seed, self.per_step, self.world,
                                                 self.balance))
        return self._epoch[1]

    def pack_ids(self, epoch: int, index: int) -> list[int]:
        """Step ``index`` of epoch ``epoch``, in the order :func:`rank_units` slices (rank r: r, r+world, ...)."""
        return step_pack_ids(self.schedule(epoch)[index])


def step_examples(plan: Plan, pack_ids: list[int]) -> int:
    return sum(len(plan.packs[i].examples) for i in pack_ids)


def _units(plan: Plan, pack_ids: list[int], mode: str) -> list[Unit]:
    units = []
    for i in pack_ids:
        pack = plan.packs[i]
        if pack.schedule is not None:
            units.append(Unit(pack.prompt, pack.examples, schedule=pack.schedule))
        elif mode == "shared_prefix":
            units.append(Unit(pack.prompt, pack.examples))
        else:
            units.extend(Unit(pack.prompt, (e,)) for e in pack.examples)
    return units


def equal_slots(per_rank: list[list[Unit]], rank: int) -> list[Unit]:
    """The equal-call rule for one kind of unit: ``rank``'s units padded to the most any rank has, with dummies (a
    copy of its first unit, or of the first unit any rank has, on one example), and every walk in slot k given the
    largest schedule of slot k."""
    if not any(per_rank):
        return []
    mine = per_rank[rank]
    filler = mine[0] if mine else next(u for units in per_rank for u in units)
    slots = max(len(units) for units in per_rank)
    out = mine + [dataclasses.replace(filler, examples=filler.examples[:1], dummy=True)] * (slots - len(mine))
    for k, unit in enumerate(out):
        if unit.schedule is not None:
            # the real walks of slot k alone decide it: a dummy's own schedule (its filler's) is another slot's
            real = [units[k].schedule for units in per_rank if k < len(units)]
            slot = real[0]
            for other in real[1:]:
                slot = slot.pad(other)
            out[k] = dataclasses.replace(unit, schedule=slot)
    return out


def rank_units(plan: Plan, pack_ids: list[int], mode: str, rank: int, world: int) -> list[Unit]:
    """``rank``'s units of the step made of ``pack_ids``: its packs, then its walks, under the equal-call rule."""
    per_rank = [_units(plan, pack_ids[r::world], mode) for r in range(world)]
    packs = [[u for u in units if u.schedule is None] for units in per_rank]
    walks = [[u for u in units if u.schedule is not None] for units in per_rank]
    return equal_slots(packs, rank) + equal_slots(walks, rank)
