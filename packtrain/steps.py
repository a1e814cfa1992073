"""What each rank computes in each optimizer step, derived from the plan alone (so every rank agrees).

A step takes ``train.packs_per_step`` packs (global, across ranks) in the epoch's seeded order. Rank r takes
packs r, r+world, ... of the step. A *unit* is one forward/backward: a whole pack in shared-prefix mode, one
example in standalone mode (so both modes see the same examples per update). Every rank runs the same number
of units per step, padding with dummy units (real inputs, loss scaled by zero): FSDP's collectives deadlock
when one rank makes fewer calls than another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from packtrain.layout import Continuation, PackLayout, build_pack_layout, build_standalone_layout
from packtrain.planner import Plan, epoch_order


@dataclass(frozen=True)
class Unit:
    prompt: int
    examples: tuple[int, ...]
    dummy: bool = False


def steps_per_epoch(plan: Plan, packs_per_step: int) -> int:
    return math.ceil(len(plan.packs) / packs_per_step)


def step_packs(plan: Plan, epoch: int, index: int, packs_per_step: int, seed: int) -> list[int]:
    order = epoch_order(plan, epoch, seed)
    return order[index * packs_per_step:(index + 1) * packs_per_step]


def _units(plan: Plan, pack_ids: list[int], mode: str) -> list[Unit]:
    units = []
    for i in pack_ids:
        pack = plan.packs[i]
        if mode == "shared_prefix":
            units.append(Unit(pack.prompt, pack.examples))
        else:
            units.extend(Unit(pack.prompt, (e,)) for e in pack.examples)
    return units


def rank_units(plan: Plan, pack_ids: list[int], mode: str, rank: int, world: int) -> list[Unit]:
    per_rank = [_units(plan, pack_ids[r::world], mode) for r in range(world)]
    target = max(len(u) for u in per_rank)
    mine = per_rank[rank]
    if len(mine) < target:
        filler = mine[0] if mine else _units(plan, pack_ids[:1], mode)[0]
        mine = mine + [Unit(filler.prompt, filler.examples[:1], dummy=True)] * (target - len(mine))
    return mine


def step_examples(plan: Plan, pack_ids: list[int]) -> int:
    return sum(len(plan.packs[i].examples) for i in pack_ids)


def unit_layout(unit: Unit, plan: Plan, examples, mode: str) -> PackLayout:
    prefix = plan.prompts[unit.prompt]
    conts = [Continuation(examples[e].item_ids, examples[e].target_ids) for e in unit.examples]
    if mode == "shared_prefix":
        return build_pack_layout(prefix, conts)
    (cont,) = conts
    return build_standalone_layout(prefix, cont)
