"""The unit runner: the one place a unit is prepared and run, for training, eval, bench, smoke and the harness.

A *unit* (:class:`packtrain.run.steps.Unit`) is one forward/backward of a step: a whole pack (shared-prefix mode),
a pack in continuation groups (``packing.continuation_groups``), a walked example (``packing.on_overflow: walk``),
one example alone (standalone mode), or a dummy (any of these on one example, its loss scaled by zero, so that
every rank issues the same collective calls: :mod:`packtrain.run.steps`). :func:`prepare` builds what a unit runs
on (its layout, or its groups' layouts) and :func:`run_unit` runs it; nothing else dispatches on unit kinds.

The loss scale: a unit's ``loss_sum`` (the sum of its examples' mean target cross-entropies) is multiplied by
``scale``, which the caller derives with :func:`step_scale` from the examples of the whole optimizer step, so that
the update is the mean of per-example losses whatever the split into packs, units or ranks. A dummy unit's scale is
``scale * 0`` (zero, and NaN stays NaN, so an injected NaN shows on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from packtrain.config import Config, WalkSpec
from packtrain.data.examples import processor_dir
from packtrain.data.images import ImageLoader, load_image_processor
from packtrain.data.planner import Plan
from packtrain.packed.groups import Groups, group_units, train_groups
from packtrain.packed.layout import Continuation, PackLayout, build_pack_layout, build_standalone_layout
from packtrain.packed.lm import PackCall
from packtrain.packed.loss import require_grad
from packtrain.packed.patch import vision_spec
from packtrain.packed.walk import eval_walk, train_walk
from packtrain.run.steps import Unit


@dataclass(frozen=True)
class UnitSetup:
    """How a run's units are built and run, chosen once at setup."""
    mode: str  # packing.mode: shared_prefix | standalone
    n_groups: int = 1  # packing.continuation_groups (1: a pack is one call)
    walk_spec: WalkSpec | None = None  # packing.on_overflow: walk (None: no example is walked)
    images: ImageLoader | None = None


@dataclass
class Prepared:
    """A unit and what it runs on: a layout (a pack, a standalone or a walked example) or a pack's groups."""
    unit: Unit
    work: PackLayout | Groups

    @property
    def positions(self) -> int:
        return self.work.length


@dataclass
class UnitResult:
    loss_sum: float  # the sum of its examples' losses (0 for a dummy)
    per_example: list[float]  # in the unit's example order (empty for a dummy)
    target_tokens: list[int]
    positions: int  # buffer positions computed for real examples (0 for a dummy)
    calls: int  # forward calls of the root module: each runs FSDP's collectives


def step_scale(step_examples: int) -> float:
    """The loss scale of every unit of a step, on every rank: 1 / (the step's examples, all ranks together). FSDP
    sums the ranks' gradients (:func:`packtrain.models.wrap.prepare`), so the update is the mean over the step's
    examples, and a pack's backward is the same on any world size."""
    return 1.0 / step_examples


def unit_layout(unit: Unit, plan: Plan, examples, mode: str, images: ImageLoader | None = None,
                items_only: bool = False) -> PackLayout | None:
    """The layout of one unit; with ``images``, its examples' images are loaded (in buffer order) as well.
    ``items_only``: a pack of the examples' items alone, those with an item (a generation's prompts; None when no
    example has one)."""
    prefix = plan.prompts[unit.prompt]
    chosen = [examples[e] for e in unit.examples if not items_only or examples[e].item_ids]
    if not chosen:
        return None
    if any(getattr(ex, "images", ()) for ex in chosen) and images is None:
        raise ValueError(f"{chosen[0].source}: examples with images need a vision-language model and an image "
                         "processor")
    spec = images.spec if images is not None else None
    per_example = [_item_images(ex, spec) if items_only else tuple(getattr(ex, "images", ())) for ex in chosen]
    conts = [Continuation(ex.item_ids, () if items_only else ex.target_ids, [r.grid_thw for r in refs],
                          () if items_only else getattr(ex, "spans", ())) for ex, refs in zip(chosen, per_example)]
    refs = [r for ex_refs in per_example for r in ex_refs]
    if items_only:
        layout = build_pack_layout(prefix, conts, spec, targets=False)
    elif mode == "shared_prefix" and unit.schedule is None:
        layout = build_pack_layout(prefix, conts, spec)
    else:
        (cont,) = conts
        layout = build_standalone_layout(prefix, cont, spec)
    if refs:
        layout.pixel_values, _ = images.load(refs)
    return layout


def _item_images(ex, spec) -> tuple:
    """The images of an example's item alone (under ``data.train_on: all`` later user turns may hold more)."""
    refs = tuple(getattr(ex, "images", ()))
    if not refs:
        return refs
    pads, n = ex.item_ids.count(spec.image_token_id), 0
    for k, ref in enumerate(refs):
        n += spec.tokens(ref.grid_thw)
        if n > pads:
            return refs[:k]
    return refs


def unit_groups(unit: Unit, plan: Plan, examples, n_groups: int, images: ImageLoader | None = None) -> Groups:
    """A pack's continuations in ``n_groups`` groups (``packing.continuation_groups``,
    :mod:`packtrain.packed.groups`)."""
    lengths = [len(examples[e].item_ids) + len(examples[e].target_ids) for e in unit.examples]
    units, weights = group_units(unit, lengths, n_groups)
    return Groups([unit_layout(u, plan, examples, "shared_prefix", images) for u in units], weights)


def prepare(unit: Unit, plan: Plan, examples, setup: UnitSetup) -> Prepared:
    if setup.mode == "shared_prefix" and setup.n_groups > 1 and unit.schedule is None:
        return Prepared(unit, unit_groups(unit, plan, examples, setup.n_groups, setup.images))
    return Prepared(unit, unit_layout(unit, plan, examples, setup.mode, setup.images))


def over_cap(prepared: Prepared, max_positions: int | None) -> bool:
    """``train.max_positions``: a pack or an example over it is skipped; a walked example never is (one window of
    it is in memory at a time)."""
    return max_positions is not None and prepared.unit.schedule is None and prepared.positions > max_positions


def run_unit(lm, prepared: Prepared, setup: UnitSetup, device, scale: float | None = None) -> UnitResult:
    """Run one unit on ``device``: training (forward and backward, gradients accumulated into the parameters,
    ``loss_sum * scale``) when ``scale`` is given, else evaluation under no_grad."""
    unit, work = prepared.unit, prepared.work.to(device)
    if unit.dummy and scale is not None:
        scale = scale * 0.0
    calls = lm.calls
    if scale is None:
        with torch.no_grad():
            loss_sum, per_example, targets = _evaluate(lm, unit, work, setup)
    else:
        loss_sum, per_example, targets = _train(lm, unit, work, setup, scale)
    calls = lm.calls - calls
    if unit.dummy:
        return UnitResult(0.0, [], [], 0, calls)
    return UnitResult(loss_sum, per_example, targets, work.length, calls)


def _train(lm, unit: Unit, work, setup: UnitSetup, scale: float):
    if unit.schedule is not None:  # an over-budget example, chunk by chunk; backward inside (packtrain/packed/walk.py)
        r = train_walk(lm, work, setup.walk_spec, scale, unit.schedule, unit.dummy)
        return r.loss, [r.loss], [r.target_tokens]
    if isinstance(work, Groups):  # the pack's continuations in groups; backward inside (packtrain/packed/groups.py)
        total, losses = train_groups(lm, work, scale)
        targets = [n for lay, w in zip(work.layouts, work.weights) if w for n in lay.target_counts.tolist()]
        return total, losses, targets
    out = lm(PackCall(work))
    require_grad(out.loss_sum)
    (out.loss_sum * scale).backward()
    return out.per_example.sum().item(), out.per_example.tolist(), out.target_tokens.tolist()


def _evaluate(lm, unit: Unit, work, setup: UnitSetup):
    if unit.schedule is not None:
        r = eval_walk(lm, work, setup.walk_spec, unit.schedule.chunks, unit.dummy)
        return r.loss, [r.loss], [r.target_tokens]
    if isinstance(work, Groups):
        raise ValueError("evaluation runs whole packs: prepare eval units with n_groups=1")
    out = lm(PackCall(work))
    return out.per_example.sum().item(), out.per_example.tolist(), out.target_tokens.tolist()


def image_loader(cfg: Config, model, examples) -> ImageLoader | None:
    """The loader for examples' images (None when no example has one); refuses a text-only model."""
    if not any(ex.images for ex in examples):
        return None
    spec = vision_spec(model)
    if spec is None:
        raise ValueError("the data has images but the model is text-only: use a vision-language model "
                         "(model_type qwen3_5 or qwen3_5_moe)")
    return ImageLoader(load_image_processor(processor_dir(cfg)), spec)
