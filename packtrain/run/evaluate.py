"""Per-example evaluation losses, packed (default) or standalone, on every rank's share of the packs."""

from __future__ import annotations

import torch
import torch.distributed as dist

from packtrain.data.images import ImageLoader
from packtrain.data.planner import Plan
from packtrain.data.walk_schedule import WalkSpec
from packtrain.distributed import DistInfo
from packtrain.packed.lm import PackedLM
from packtrain.packed.walk import eval_walk
from packtrain.run.steps import rank_units, unit_layout


@torch.no_grad()
def evaluate(lm: PackedLM, plan: Plan, examples, mode: str, info: DistInfo, progress=None,
             images: ImageLoader | None = None, walk: WalkSpec | None = None) -> list[dict]:
    """``[{"id", "loss", "target_tokens"}]`` in example order (on every rank), skipped examples left out; walked
    examples (``walk``: the run's settings) chunk by chunk."""
    was_training = lm.training
    lm.eval()
    results: dict[int, tuple[float, int]] = {}
    units = rank_units(plan, list(range(len(plan.packs))), mode, info.rank, info.world_size)
    for unit in units:
        layout = unit_layout(unit, plan, examples, mode, images).to(info.device)
        if unit.walk is not None:
            r = eval_walk(lm, layout, walk, unit.walk.chunks, unit.dummy)
            losses, counts = [r.loss], [r.target_tokens]
        else:
            out = lm(layout)
            losses, counts = out.per_example.tolist(), out.target_tokens.tolist()
        if not unit.dummy:
            for e, loss, n in zip(unit.examples, losses, counts):
                results[e] = (loss, n)
        if progress is not None:
            progress.update(1)
    if info.enabled:
        gathered = [None] * info.world_size
        dist.all_gather_object(gathered, results)
        results = {k: v for part in gathered for k, v in part.items()}
    lm.train(was_training)
    return [{"id": examples[e].id, "loss": results[e][0], "target_tokens": results[e][1]} for e in sorted(results)]


def mean_loss(rows: list[dict]) -> float:
    return sum(r["loss"] for r in rows) / len(rows)
