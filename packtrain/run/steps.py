"""What each rank computes in each optimizer step, derived from the plan alone (so every rank agrees).

A step takes ``train.packs_per_step`` packs (global, across ranks) in the epoch's seeded order. Rank r takes
packs r, r+world, ... of the step. A *unit* is one forward/backward: a whole pack in shared-prefix mode, one
example in standalone mode (so both modes see the same examples per update). Every rank runs the same number
of units per step, padding with dummy units (real inputs, loss scaled by zero): FSDP's collectives deadlock
when one rank makes fewer calls than another. A walked example (``packing.on_overflow: walk``) is a unit of its
own in both modes; each rank runs its packs first, then its walks, and every walk slot is padded to the same
schedule on every rank (dummy walks and dummy chunks), so all ranks issue the same sequence of calls.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from packtrain.data.images import ImageLoader
from packtrain.data.planner import Plan, epoch_order
from packtrain.data.walk_schedule import Schedule
from packtrain.packed.groups import Groups, group_units
from packtrain.packed.layout import Continuation, PackLayout, build_pack_layout, build_standalone_layout


@dataclass(frozen=True)
class Unit:
    prompt: int
    examples: tuple[int, ...]
    dummy: bool = False
    walk: Schedule | None = None  # a walked example: the schedule every rank issues in its slot


def steps_per_epoch(plan: Plan, packs_per_step: int) -> int:
    return math.ceil(len(plan.packs) / packs_per_step)


def step_packs(plan: Plan, epoch: int, index: int, packs_per_step: int, seed: int) -> list[int]:
    order = epoch_order(plan, epoch, seed)
    return order[index * packs_per_step:(index + 1) * packs_per_step]


def _units(plan: Plan, pack_ids: list[int], mode: str) -> list[Unit]:
    units = []
    for i in pack_ids:
        pack = plan.packs[i]
        if pack.walk is not None:
            units.append(Unit(pack.prompt, pack.examples, walk=pack.walk))
        elif mode == "shared_prefix":
            units.append(Unit(pack.prompt, pack.examples))
        else:
            units.extend(Unit(pack.prompt, (e,)) for e in pack.examples)
    return units


def _padded(per_rank: list[list[Unit]], rank: int, filler: Unit) -> list[Unit]:
    target = max(len(u) for u in per_rank)
    mine = per_rank[rank]
    filler = mine[0] if mine else filler
    return mine + [dataclasses.replace(filler, examples=filler.examples[:1], dummy=True)] * (target - len(mine))


def rank_units(plan: Plan, pack_ids: list[int], mode: str, rank: int, world: int) -> list[Unit]:
    per_rank = [_units(plan, pack_ids[r::world], mode) for r in range(world)]
    packs = [[u for u in units if u.walk is None] for units in per_rank]
    walks = [[u for u in units if u.walk is not None] for units in per_rank]
    mine = []
    if any(packs):
        mine += _padded(packs, rank, next(u for units in packs for u in units))
    if any(walks):
        slots = _padded(walks, rank, next(u for units in walks for u in units))
        for k, unit in enumerate(slots):  # every rank's walk in slot k runs the largest schedule of that slot
            pad = unit.walk
            for units in walks:
                pad = pad.pad(units[k].walk) if k < len(units) else pad
            mine.append(dataclasses.replace(unit, walk=pad))
    return mine


def step_examples(plan: Plan, pack_ids: list[int]) -> int:
    return sum(len(plan.packs[i].examples) for i in pack_ids)


def unit_layout(unit: Unit, plan: Plan, examples, mode: str, images: ImageLoader | None = None) -> PackLayout:
    """The layout of one unit; with ``images``, its examples' images are loaded (in buffer order) as well."""
    prefix = plan.prompts[unit.prompt]
    chosen = [examples[e] for e in unit.examples]
    conts = [Continuation(ex.item_ids, ex.target_ids, [r.grid_thw for r in getattr(ex, "images", ())])
             for ex in chosen]
    refs = [r for ex in chosen for r in getattr(ex, "images", ())]
    if refs and images is None:
        raise ValueError(f"{chosen[0].source}: examples with images need a vision-language model and an image "
                         "processor")
    spec = images.spec if images is not None else None
    if mode == "shared_prefix" and unit.walk is None:
        layout = build_pack_layout(prefix, conts, spec)
    else:
        (cont,) = conts
        layout = build_standalone_layout(prefix, cont, spec)
    if refs:
        layout.pixel_values, _ = images.load(refs)
    return layout


def unit_groups(unit: Unit, plan: Plan, examples, n_groups: int, images: ImageLoader | None = None) -> Groups:
    """A pack's continuations in ``n_groups`` groups (``packing.continuation_groups``, :mod:`packtrain.packed.groups`)."""
    lengths = [len(examples[e].item_ids) + len(examples[e].target_ids) for e in unit.examples]
    units, weights = group_units(unit, lengths, n_groups)
    return Groups([unit_layout(u, plan, examples, "shared_prefix", images) for u in units], weights)
