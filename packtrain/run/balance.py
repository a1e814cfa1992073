"""The packs of every optimizer step (:class:`StepPlan`, the one source of a run's steps: the trainer, the bench and
the harness all take theirs from it), from the plan alone, so every rank computes the same ones.

Balanced steps (``train.balance: cost``, the default): an epoch's packs go into optimizer steps so that packs of similar cost
share a step, and within a step every rank gets the same number of packs, the costliest first to the least loaded
rank. A step lasts as long as its costliest rank (the collectives wait for it), so the figure that matters is the
**utilisation**: per step the mean rank cost over the largest, averaged over the epoch's steps.

Cost of a pack: the cost model's FLOPs of one forward and backward (:mod:`packtrain.models.cost`, the one count the
savings and the bench use too) of its positions and its query-key pairs of causal attention (P's own, and each
continuation's against P and itself; a tree pack's: each token's against P, its ancestors and its own node's earlier
tokens), or measured figures in their place (``train.cost_per_position``, ``train.cost_per_pair``).

The steps of epoch e, from the plan alone (every rank computes the same one):

1. the packs in the epoch's seeded order (:func:`packtrain.data.planner.epoch_order`), then sorted by cost,
   descending (stable: the shuffle breaks ties);
2. steps of :meth:`~packtrain.config.Config.packs_per_step` packs (``train.packs_per_rank`` x the world size, or
   ``train.packs_per_step``) taken down that list. A step of neighbours in cost would hold few
   prompts (a prompt's full packs cost the same), so a step keeps at least :data:`DIVERSITY` of the distinct prompts
   a round-robin step of this epoch has on average: past that many repeats, a pack of a prompt already in the step
   waits for the next step while another prompt's pack takes the slot;
3. the steps in an order seeded by (seed, epoch): the trajectory visits costly and cheap steps mixed;
4. in each step, the packs to ranks: costliest first, each to the least loaded rank that has room (every rank gets
   the step's packs / world, the first ranks one more when it does not divide).

Given the step's packs (``train.packs_per_step``), which packs form a step does not depend on the world size (only
step 4 does), so 1 rank and 64 ranks train the same steps; with ``train.packs_per_rank`` a step grows with the
ranks, as a per-device batch does. ``round_robin`` is the order of ``epoch_order`` cut into steps, rank r taking
slots r, r+world, ...
"""

from __future__ import annotations

import math
from collections import deque

from packtrain.config import Config
from packtrain.data.planner import Plan, epoch_order, seeded
from packtrain.models.cost import CostModel

BALANCES = ("cost", "round_robin")
# The share of round robin's distinct prompts per step that a balanced step keeps (a step of similar packs would
# otherwise be a few prompts' full packs: less diverse updates)
DIVERSITY = 0.85
# How far down the list a step looks for another prompt's pack, in steps' lengths (tools/bench/balance.py: at 1 a
# step of the seed-like data kept 78% of round robin's distinct prompts, at 4 93%, for 0.002 of utilisation)
LOOKAHEAD = 4


def pack_attention_pairs(plan: Plan, examples) -> list[int]:
    """Each pack's attention pairs, by pack index (the planner's
    :attr:`~packtrain.data.planner.Pack.attention_pairs`)."""
    return [p.attention_pairs for p in plan.packs]


def pack_costs(plan: Plan, examples, model: CostModel) -> list[float]:
    """Each pack's cost, by pack index: the cost model's FLOPs of its positions and its attention pairs (a walked
    example: its whole sequence, as one continuation; a tree pack: its tree's positions and pairs); its head rows
    left out (:mod:`packtrain.models.cost`)."""
    return [model.flops(p.positions, p.attention_pairs) for p in plan.packs]


def _similar_cost_steps(plan: Plan, order: list[int], costs: list[float], per_step: int,
                        distinct: int) -> list[list[int]]:
    """Step 2 of the module docstring: down the cost-sorted list; once a step holds ``per_step - distinct`` packs
    of prompts it already had, a pack whose prompt the step has waits (up to :data:`LOOKAHEAD` steps' lengths of
    them) while another prompt's pack takes the slot."""
    pending = deque(sorted(order, key=lambda i: -costs[i]))
    steps = []
    while pending:
        step, seen, waiting, repeats = [], set(), deque(), 0
        while len(step) < per_step and pending:
            i = pending.popleft()
            prompt = plan.packs[i].prompt
            if prompt in seen and repeats >= per_step - distinct and len(waiting) < LOOKAHEAD * per_step:
                waiting.append(i)
            else:
                repeats += prompt in seen
                step.append(i)
                seen.add(prompt)
        while len(step) < per_step and waiting:  # too few prompts left: repeats fill the step
            step.append(waiting.popleft())
        steps.append(step)
        pending.extendleft(reversed(waiting))
    return steps


def _to_ranks(step: list[int], costs: list[float], world: int) -> list[list[int]]:
    """Step 4: costliest first to the least loaded rank with room; rank r gets len // world (+1 for the first
    len % world ranks)."""
    base, extra = divmod(len(step), world)
    room = [base + (r < extra) for r in range(world)]
    loads, out = [0.0] * world, [[] for _ in range(world)]
    for i in sorted(step, key=lambda i: (-costs[i], i)):
        r = min((r for r in range(world) if room[r]), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += costs[i]
        room[r] -= 1
    return out


def epoch_steps(plan: Plan, costs: list[float], epoch: int, seed: int, per_step: int, world: int,
                   balance: str = "cost") -> list[list[list[int]]]:
    """Epoch ``epoch``'s steps, each a list over ranks of pack indices."""
    order = epoch_order(plan, epoch, seed)
    rounds = [order[k:k + per_step] for k in range(0, len(order), per_step)]
    if balance == "round_robin":
        return [[step[r::world] for r in range(world)] for step in rounds]
    if balance != "cost":
        raise ValueError(f"train.balance: expected one of {', '.join(BALANCES)}, got {balance!r}")
    # keep DIVERSITY of round robin's distinct prompts per step (its mean over this epoch's steps)
    mean_distinct = sum(len({plan.packs[i].prompt for i in step}) for step in rounds) / len(rounds)
    steps = _similar_cost_steps(plan, order, costs, per_step, min(per_step, math.ceil(DIVERSITY * mean_distinct)))
    seeded(seed, epoch, "steps").shuffle(steps)
    return [_to_ranks(step, costs, world) for step in steps]


def step_pack_ids(ranks: list[list[int]]) -> list[int]:
    """A step's packs in the order the step runner slices them (rank r's at r, r + world, ...)."""
    world, out = len(ranks), []
    for j in range(max((len(p) for p in ranks), default=0)):
        out.extend(p[j] for p in ranks if j < len(p))
    assert all(out[r::world] == ranks[r] for r in range(world)), "ranks' pack counts must not increase with r"
    return out


def utilisation(steps: list[list[list[int]]], costs: list[float]) -> float:
    """Mean over steps of (mean rank cost / largest rank cost): 1.0 when no rank waits."""
    ratios = []
    for ranks in steps:
        loads = [sum(costs[i] for i in packs) for packs in ranks]
        if max(loads) > 0:
            ratios.append(sum(loads) / len(loads) / max(loads))
    return sum(ratios) / len(ratios) if ratios else 1.0


def distinct_prompts(steps: list[list[list[int]]], plan: Plan) -> float:
    """Mean distinct prompts per step."""
    counts = [len({plan.packs[i].prompt for packs in ranks for i in packs}) for ranks in steps]
    return sum(counts) / len(counts) if counts else 0.0


def idle_ranks(cfg: Config, world: int) -> str | None:
    """The warning for ``train.packs_per_step`` at ``world`` ranks, None when every rank works: fewer packs per step
    than ranks leaves ranks idle at every step (a rank with no pack runs a dummy unit: the same update, at the cost
    of a GPU); a count that does not divide among the ranks leaves some waiting for part of every step."""
    per_step = cfg.train.packs_per_step
    if per_step is None or per_step % world == 0:
        return None
    fix = (f"set train.packs_per_rank (packs each rank trains per step: {per_step // world or 1} gives "
           f"{(per_step // world or 1) * world} per step) in place of train.packs_per_step, or packs_per_step to a "
           f"multiple of {world}")
    if per_step < world:
        return (f"WARNING: train.packs_per_step {per_step} over {world} ranks leaves {world - per_step} of them idle "
                f"at every step (utilisation at most {per_step / world:.2f}): {fix}")
    return (f"warning: train.packs_per_step {per_step} does not divide among {world} ranks: {world - per_step % world} "
            f"of them wait out part of every step; {fix}")


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
        return cls(plan, pack_costs(plan, examples, CostModel.for_config(cfg)), cfg.packs_per_step(world), t.seed,
                   world, t.balance)

    def epoch_steps(self, epoch: int) -> list[list[list[int]]]:
        """Epoch ``epoch``'s steps, each a list over ranks of pack indices."""
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_steps(self.plan, self.costs, epoch, self.seed, self.per_step, self.world,
                                                 self.balance))
        return self._epoch[1]

    def pack_ids(self, epoch: int, index: int) -> list[int]:
        """Step ``index`` of epoch ``epoch``, in the order :func:`rank_units` slices (rank r: r, r+world, ...)."""
        return step_pack_ids(self.epoch_steps(epoch)[index])
