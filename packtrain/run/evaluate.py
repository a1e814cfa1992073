"""Per-example evaluation losses, packed (default) or standalone, on every rank's share of the packs."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from packtrain.data.planner import Plan
from packtrain.distributed import DistInfo
from packtrain.run.step import rank_units
from packtrain.run.units import Kinds, build, run_unit


def evaluate(lm, plan: Plan, examples, kinds: Kinds, info: DistInfo, progress=None, tokens: bool = False
             ) -> list[dict]:
    """``[{"id", "loss", "target_tokens"}]`` in example order (on every rank), skipped examples left out; every unit
    through the unit runner under no_grad (whole packs, whatever ``packing.continuation_groups``; walked examples
    chunk by chunk). ``tokens``: each row's ``token_logp`` too, its target tokens' log-probabilities (not walked)."""
    # an evaluation reads no loss terms: a dpo run's reference table (of data.train) need not name data.eval's ids
    kinds = dataclasses.replace(kinds.whole_packs(), objective=kinds.objective.with_table(None))
    was_training = lm.training
    lm.eval()
    results: dict[int, tuple] = {}
    units = rank_units(plan, list(range(len(plan.packs))), kinds, info.rank, info.world_size)
    for unit in units:
        r = run_unit(lm, build(unit, plan, examples, kinds), kinds, info.device)
        if tokens and r.token_logp is None and r.per_example:
            raise RuntimeError(f"a {unit.kind.name} unit gives no per-token log-probabilities")
        split = tokens and r.token_logp is not None  # (a dummy's: none)
        logps = r.token_logp.split(r.target_tokens) if split else [None] * len(r.per_example)
        for e, loss, n, logp in zip(unit.examples, r.per_example, r.target_tokens, logps):
            results[e] = (loss, n, None if logp is None else logp.tolist())
        if progress is not None:
            progress.update(1)
    if info.enabled:
        gathered = [None] * info.world_size
        dist.all_gather_object(gathered, results)
        results = {k: v for part in gathered for k, v in part.items()}
    lm.train(was_training)
    return [{"id": examples[e].id, "loss": results[e][0], "target_tokens": results[e][1],
             **({"token_logp": results[e][2]} if tokens else {})} for e in sorted(results)]


def mean_loss(rows: list[dict]) -> float:
    return sum(r["loss"] for r in rows) / len(rows)
