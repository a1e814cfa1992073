"""What each rank computes in each optimizer step, derived from the plan alone (so every rank agrees).

A step takes ``train.packs_per_step`` packs (global, across ranks): under ``train.balance: cost`` (the default)
packs of similar cost, spread over the ranks evenly by cost (:mod:`packtrain.run.balance`); under ``round_robin``
the next packs of the epoch's seeded order. Rank r takes packs r, r+world, ... of the step's list, and makes their
units (:meth:`packtrain.run.units.Kinds.units`, which stamps each unit's kind: a whole pack, a pack in groups, one
example alone, a prefix tree, a walked example), padded by the equal-call rule (:func:`packtrain.run.units.pad_units`): every rank
issues the same sequence of calls. Each rank runs its packs first, then its walks. :class:`StepPlan` is the one
source of a run's steps: the trainer, the bench and the harness all take theirs from it.
"""

from __future__ import annotations

import math

from packtrain.config import Config
from packtrain.data.planner import Plan
from packtrain.models.cost import CostModel
from packtrain.run.balance import epoch_steps, pack_costs, step_pack_ids
from packtrain.run.units import Kinds, Unit, pad_units


def steps_per_epoch(plan: Plan, packs_per_step: int) -> int:
    return math.ceil(len(plan.packs) / packs_per_step)


def step_packs(plan: Plan, epoch: int, index: int, packs_per_step: int, seed: int) -> list[int]:
    """Round robin: step ``index`` of epoch ``epoch`` as the next packs of the epoch's seeded order."""
    return epoch_steps(plan, [], epoch, seed, packs_per_step, 1, "round_robin")[index][0]


class StepPlan:
    """The packs of every step of a run under ``train.balance``; each epoch's steps are computed once."""

    def __init__(self, plan: Plan, costs: list[float], packs_per_step: int, seed: int, world: int,
                 balance: str = "cost"):
        self.plan, self.costs, self.per_step, self.seed, self.world, self.balance = (
            plan, costs, packs_per_step, seed, world, balance)
        self.steps_per_epoch = steps_per_epoch(plan, packs_per_step)
        self._epoch: tuple[int, list] | None = None

    @classmethod
    def for_run(cls, cfg: Config, plan: Plan, examples, world: int) -> StepPlan:
        """The steps ``packtrain train`` runs on ``plan`` at ``world`` ranks (``train.*``, the config's cost model)."""
        t = cfg.train
        return cls(plan, pack_costs(plan, examples, CostModel.for_config(cfg)), t.packs_per_step, t.seed, world,
                   t.balance)

    def epoch_steps(self, epoch: int) -> list[list[list[int]]]:
        """Epoch ``epoch``'s steps, each a list over ranks of pack indices."""
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_steps(self.plan, self.costs, epoch, self.seed, self.per_step, self.world,
                                                 self.balance))
        return self._epoch[1]

    def pack_ids(self, epoch: int, index: int) -> list[int]:
        """Step ``index`` of epoch ``epoch``, in the order :func:`rank_units` slices (rank r: r, r+world, ...)."""
        return step_pack_ids(self.epoch_steps(epoch)[index])


def step_examples(plan: Plan, pack_ids: list[int]) -> int:
    return sum(len(plan.packs[i].examples) for i in pack_ids)


def rank_units(plan: Plan, pack_ids: list[int], kinds: Kinds, rank: int, world: int) -> list[Unit]:
    """``rank``'s units of the step made of ``pack_ids``: its packs, then its walks, under the equal-call rule."""
    per_rank = [[u for i in pack_ids[r::world] for u in kinds.units(plan.packs[i])] for r in range(world)]
    return pad_units(per_rank, rank, kinds)
