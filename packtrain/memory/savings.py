"""Which memory savings a training step takes, chosen by need: the fastest combination whose estimate fits.

The five savings (``train.*``; ``auto`` is the default of each, a value given is kept):

| key | saving | what it costs |
|---|---|---|
| ``activation_checkpointing`` | a decoder layer keeps only its input; backward recomputes it | one more forward of every layer |
| ``offload`` | the first N layers' checkpointed inputs in host memory | host memory, and each input's copy out and back where the layer's own compute does not hide it |
| ``loss_chunk_rows`` | lm_head + cross-entropy in chunks, recomputed | one more forward of the head on the target rows |
| ``mlp_chunk_rows`` | the dense MLP in row tiles, recomputed | one more forward of every dense MLP |
| ``norm_chunk_rows`` | every RMSNorm in row tiles, recomputed | one more pass of every norm (elementwise) |

:func:`choose` takes the budget (:class:`~packtrain.memory.budget.Budget`: at the start of ``train``, ``smoke`` and ``bench`` the device's
memory less :func:`~packtrain.memory.budget.device_reserve`, on the CPU the host's available memory; ``plan --memory --gpu-memory GIB``),
estimates each combination of the ``auto`` savings for the run's largest unit (:mod:`packtrain.memory.estimate`), with
as few layer inputs offloaded as make it fit (never more than the node's host memory holds: ``--ranks-per-node``
pools of pinned chunks within ``--host-memory-per-node`` / ``ops.host_memory_per_node_gib``, or the machine's
available memory at run time), and takes the one that fits with the least estimated step time, ties to the fewer
savings. On the CPU the host is the device: offload saves nothing there and is not a candidate.

The step time is :mod:`packtrain.memory.step_time`'s estimate from the model config, an assumption about a typical
device, not a measurement of this one; ``relative_step_cost`` is the ratio to the step without any saving, which is
what the choice compares. Candidates within :data:`AS_FAST` of the fastest count as as fast, and of those the one
with the fewest layer inputs in host memory (then the fewest savings) is taken.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from packtrain.config import MAX_POSITIONS
from packtrain.config.tiles import AUTO, KEYS, TILE_ROWS, offload_layers
from packtrain.memory import estimate as memory
from packtrain.memory.budget import Budget
from packtrain.memory.describe import WIDTH, fit
from packtrain.memory.estimate import OFFLOAD_CHUNK_BYTES, GiB, StepSavings, UnitShape
from packtrain.memory.step_time import step_seconds
from packtrain.models.text_config import config_dict_of, text_config
from packtrain.packed.context import context_grad as context_mode

# Candidates whose estimated step cost is within this of the least count as as fast: the estimate leaves out
# what offloading costs beside its copies' time (pinned host memory, the host link shared with the collectives),
# so of those the one with the fewest layer inputs in host memory is taken, then the one with the fewest savings
AS_FAST = 0.01


# -- the choice ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    savings: StepSavings
    device_bytes: int  # the estimate's peak
    peak_phase: str
    host_per_node: int  # the offload pools of one node's ranks
    relative_cost: float  # step_seconds over the step without any saving
    fits: bool

    def as_json(self) -> dict:
        return {"savings": dataclasses.asdict(self.savings), "total_device_bytes": self.device_bytes,
                "peak_phase": self.peak_phase, "host_per_node_bytes": self.host_per_node,
                "relative_step_cost": self.relative_cost, "fits": self.fits}


@dataclass
class Choice:
    candidates: list[Candidate]
    chosen: Candidate
    budget: Budget
    given: dict  # key -> the value the config gave (the keys not auto)
    estimate: object  # the chosen candidate's memory.MemoryEstimate
    layers: int

    def values(self) -> dict:
        """The chosen value of each ``train`` key of :data:`KEYS`, as :meth:`apply` puts them into the config."""
        s = self.chosen.savings
        return {"activation_checkpointing": s.activation_checkpointing, "offload": s.offload_layers,
                "loss_chunk_rows": s.loss_rows, "mlp_chunk_rows": s.mlp_rows, "norm_chunk_rows": s.norm_rows}

    def apply(self, cfg):
        """``cfg`` with the chosen values in ``train`` (nothing left ``auto``)."""
        train = dataclasses.replace(cfg.train, **self.values())
        return dataclasses.replace(cfg, train=train)

    def warning(self) -> str | None:
        """Said before step 0 when the chosen combination does not fit, with the figures."""
        if self.chosen.fits:
            return None
        c, b = self.chosen, self.budget
        what = "the savings given" if not (set(KEYS) - set(self.given)) else "no combination of the savings"
        over = []
        if b.device_bytes is not None and c.device_bytes > b.device_bytes:
            over.append(f"the estimate's peak {c.device_bytes / GiB:.2f} GiB ({c.peak_phase}) is over the "
                        f"{b.device_bytes / GiB:.2f} GiB the device has after its reserve")
        if b.host_per_node is not None and c.host_per_node > b.host_per_node:
            over.append(f"the offload pools of a node take {c.host_per_node / GiB:.2f} GiB of its "
                        f"{b.host_per_node / GiB:.2f} GiB of host memory")
        return (f"warning: {what} fits the largest unit: " + "; ".join(over)
                + "; lower packing.token_budget, or see `packtrain plan --memory`")

    def traded(self) -> bool:
        """Whether the choice traded step time for memory: some combination of the savings does not fit."""
        return not all(c.fits for c in self.candidates)

    def lines(self) -> list[str]:
        """The choice as `plan --memory` and a run's header print it (within the header's indent of two): when
        every combination fits, one line, the fastest being taken; else every combination considered, the chosen
        one marked."""
        given = (f"given: {', '.join(f'train.{k} {v}' for k, v in self.given.items())}" if self.given
                 else "every saving auto")
        b, n = self.budget, len(self.candidates)
        if not self.traded():
            most = max(c.device_bytes for c in self.candidates) / GiB
            each = "per GPU" if b.device == "cuda" else "per rank"
            room = (f"at most {most:.2f} of {b.device_bytes / GiB:.2f} GiB {each}" if b.device_bytes is not None
                    else "device memory unknown")
            which = f"all {n} combinations fit" if n > 1 else "the one combination fits"
            given = f"; {given}" if self.given else ""
            return fit(f"memory savings by need: {which} ({room}), the fastest taken{given}", width=WIDTH - 2)
        columns = (f"  {'':2}{'checkpointing':<14}{'offload':>9}{'loss rows':>11}{'MLP rows':>10}"
                   f"{'norm rows':>11}{'device GiB':>12}{'host/node GiB':>15}{'step cost':>11}")
        rows = [*fit(f"memory savings by need: {b.describe()}; {given}", width=WIDTH - 2), columns]
        order = sorted(self.candidates, key=lambda c: (not c.fits, c.relative_cost, c.device_bytes))
        for c in order:
            s = c.savings
            mark = "->" if c is self.chosen else ""
            rows.append(f"  {mark:<2}{'on' if s.checkpointing else 'off':<14}{s.offload_layers:>9}"
                        f"{s.loss_rows or 'whole':>11}{s.mlp_rows or 'whole':>10}{s.norm_rows or 'whole':>11}"
                        f"{c.device_bytes / GiB:>12.2f}{c.host_per_node / GiB:>15.2f}{c.relative_cost:>11.3f}"
                        + ("" if c.fits else "  does not fit"))
        rows.append("  (step cost: estimated time relative to the step without any saving; offload: layer inputs in "
                    "host memory)")
        return rows

    def as_json(self) -> dict:
        return {"budget": self.budget.as_json(), "given": self.given,
                "candidates": [c.as_json() for c in self.candidates],
                "chosen": self.candidates.index(self.chosen)}


def describe(s: StepSavings, layers: int) -> str:
    """One line of the chosen savings."""
    parts = [("checkpointing" + (f", {s.offload_layers} of {layers} layer inputs in host memory" if s.offload_layers
                                 else "")) if s.checkpointing else "no checkpointing",
             f"loss in chunks of {s.loss_rows:,} rows" if s.loss_rows else "loss whole",
             f"MLP in tiles of {s.mlp_rows:,} rows" if s.mlp_rows else "MLP whole",
             f"norms in tiles of {s.norm_rows:,} rows" if s.norm_rows else "norms whole"]
    return ", ".join(parts)


def given_values(cfg) -> dict:
    """The savings the config gives (every key not auto), as given."""
    return {k: getattr(cfg.train, k) for k in KEYS if getattr(cfg.train, k) != AUTO}


def _options(cfg, device: str, layers: int) -> dict:
    """Each saving's values to try: the given one, or off and on (the device's tile)."""
    t, tiles = cfg.train, TILE_ROWS[device]

    def rows(value, tile):
        if value == AUTO:
            return [0, tile]
        return [tile if value is None else value]  # mlp_chunk_rows null: the device's default tile

    offload = offload_layers(t.offload, layers)
    if offload != AUTO and offload > layers:
        raise ValueError(f"train.offload: {offload} layers, but the model has {layers} decoder layers")
    if t.activation_checkpointing == AUTO:
        checkpointing = [True] if offload != AUTO and offload > 0 else [False, True]
    else:
        checkpointing = [t.activation_checkpointing]
    return {"checkpointing": checkpointing, "offload": offload, "loss": rows(t.loss_chunk_rows, tiles["loss"]),
            "mlp": rows(t.mlp_chunk_rows, tiles["mlp"]), "norm": rows(t.norm_chunk_rows, tiles["norm"])}


def _host_per_node(shape: UnitShape, text: dict, b: int, offloaded: int, ranks: int, context_grad: str) -> int:
    T, _ = context_mode(context_grad).graph_rows(shape.prefix + sum(shape.lengths),
                                                 shape.prefix if shape.shares_prefix else 0, shape.group_positions)
    per_layer = math.ceil(T * text["hidden_size"] * b / OFFLOAD_CHUNK_BYTES) * OFFLOAD_CHUNK_BYTES
    return ranks * offloaded * per_layer


class _Estimator:
    """Estimates of one unit under savings, each computed once."""

    def __init__(self, cfg, shape: UnitShape, world_size: int, budget: Budget):
        self.cfg, self.shape, self.world, self.budget = cfg, shape, world_size, budget
        self.text = text_config(config_dict_of(cfg))
        self.b = memory.DTYPE_BYTES[cfg.model.dtype]
        self.layers = self.text["num_hidden_layers"]
        self._cache = {}
        self._none = None

    def estimate(self, s: StepSavings):
        if s not in self._cache:
            self._cache[s] = memory.estimate_for_unit(self.cfg, self.shape, self.world, savings=s)
        return self._cache[s]

    def host(self, offloaded: int) -> int:
        return _host_per_node(self.shape, self.text, self.b, offloaded, self.budget.ranks_per_node,
                              self.cfg.packing.context_grad)

    def fits(self, s: StepSavings) -> bool:
        b = self.budget
        device_ok = b.device_bytes is None or self.estimate(s).total() <= b.device_bytes
        return device_ok and (b.host_per_node is None or self.host(s.offload_layers) <= b.host_per_node)

    def host_cap(self) -> int:
        """The most layer inputs one node's host memory holds for its ranks."""
        if self.budget.host_per_node is None:
            return self.layers
        per_layer = self.host(1)
        return min(self.layers, self.budget.host_per_node // per_layer) if per_layer else self.layers

    def candidate(self, s: StepSavings) -> Candidate:
        est = self.estimate(s)
        seconds = step_seconds(self.text, self.shape, s, self.b, self.budget.device, self.cfg.packing.context_grad)
        if self._none is None:
            none = StepSavings(lora_in_model_dtype=True, masks_regenerated=True)
            self._none = step_seconds(self.text, self.shape, none, self.b, self.budget.device,
                                      self.cfg.packing.context_grad)
        return Candidate(s, est.total(), est.peak_phase, self.host(s.offload_layers), seconds / self._none,
                         self.fits(s))


def _least_offload(est: _Estimator, base: StepSavings) -> StepSavings:
    """``base`` with the fewest offloaded layer inputs that make it fit (the estimate falls as layers go to the host),
    at most what the host holds; that most when none fits."""
    cap = est.host_cap()
    lo, hi = 0, cap
    if not est.fits(dataclasses.replace(base, offload_layers=cap)):
        return dataclasses.replace(base, offload_layers=cap)
    while lo < hi:
        mid = (lo + hi) // 2
        if est.fits(dataclasses.replace(base, offload_layers=mid)):
            hi = mid
        else:
            lo = mid + 1
    return dataclasses.replace(base, offload_layers=lo)


def _combinations(est: _Estimator, options: dict) -> list[StepSavings]:
    found = []
    for checkpointing in options["checkpointing"]:
        for loss in options["loss"]:
            for mlp in options["mlp"]:
                for norm in options["norm"]:
                    s = StepSavings(activation_checkpointing=checkpointing, loss_rows=loss, mlp_rows=mlp,
                                    norm_rows=norm, lora_in_model_dtype=True, masks_regenerated=True)
                    offload = options["offload"]
                    if offload != AUTO:
                        s = dataclasses.replace(s, offload_layers=offload)
                    elif s.checkpointing and est.budget.device == "cuda":
                        s = _least_offload(est, s)
                    found.append(s)
    return found


def _fewest(c: Candidate) -> tuple:
    s = c.savings
    return (s.offload_layers, s.checkpointing, bool(s.mlp_rows), bool(s.norm_rows), bool(s.loss_rows), c.relative_cost)


def _fastest(fitting: list[Candidate]) -> Candidate:
    """The least estimated step time; within :data:`AS_FAST` of it, the fewest layer inputs in host memory, then the
    fewest savings."""
    best = min(c.relative_cost for c in fitting)
    return min((c for c in fitting if c.relative_cost <= best + AS_FAST), key=_fewest)


def choose(cfg, shape: UnitShape, world_size: int, budget: Budget) -> Choice:
    """The fastest combination of the savings that fits ``budget`` for the unit of ``shape`` (module docstring); the
    given ones kept. When none fits, the one with the smallest peak (:meth:`Choice.warning` says so)."""
    est = _Estimator(cfg, shape, world_size, budget)
    options = _options(cfg, budget.device, est.layers)
    candidates = [est.candidate(s) for s in dict.fromkeys(_combinations(est, options))]
    fitting = [c for c in candidates if c.fits]
    if fitting:
        chosen = _fastest(fitting)
    else:
        chosen = min(candidates, key=lambda c: (c.device_bytes, c.host_per_node, c.relative_cost))
    return Choice(candidates, chosen, budget, given_values(cfg), est.estimate(chosen.savings), est.layers)


def most_saving(cfg, budget: Budget, layers: int, host_cap: int) -> StepSavings:
    """Every auto saving on (the device's tiles, as many layer inputs offloaded as the host holds), the given ones
    kept: the least memory the savings reach."""
    options = _options(cfg, budget.device, layers)
    offload = options["offload"]
    if offload == AUTO:
        offload = host_cap if budget.device == "cuda" and True in options["checkpointing"] else 0
    return StepSavings(activation_checkpointing=max(options["checkpointing"]), offload_layers=offload,
                       loss_rows=_most(options["loss"]), mlp_rows=_most(options["mlp"]),
                       norm_rows=_most(options["norm"]), lora_in_model_dtype=True, masks_regenerated=True)


def _most(values: list[int]) -> int:
    """The most saving of row counts: the smallest tile (0, whole, saves least)."""
    tiles = [v for v in values if v]
    return min(tiles) if tiles else 0


# -- the largest budget (`plan --memory --gpu-memory GIB`) ---------------------------------------------------------------
def max_token_budget(cfg, shape: UnitShape, world_size: int, budget: Budget, gib: float) -> dict:
    """The largest ``packing.token_budget`` whose estimate fits ``budget`` (the GPU's ``gib`` less the reserve) with
    the most saving combination (:func:`most_saving`): the largest unit's (``shape``) P with as many continuations of
    its mean length and mean target tokens as the budget holds (a binary search over budgets). A tree's
    continuations are its leaves, each with its share of the tree's positions and targets."""
    p, n0 = shape.prefix, shape.continuations
    mean_len, mean_targets = sum(shape.lengths) / n0, sum(shape.targets) / n0
    text = text_config(config_dict_of(cfg))
    layers = text["num_hidden_layers"]

    def at(positions: int):
        n = max(1, int((positions - p) / mean_len))
        unit = UnitShape(p, [round(mean_len)] * n, [round(mean_targets)] * n)
        est = _Estimator(cfg, unit, world_size, budget)
        s = most_saving(cfg, budget, layers, est.host_cap())
        # the estimate at exactly `positions` (the unit above rounds its lengths)
        e = memory._plan_estimate(cfg, text, world_size, cfg.packing.context_grad, positions,
                                  round(n * mean_targets), n, p, None, s)
        return n, e, s

    limit = budget.device_bytes
    lo = hi = p + math.ceil(mean_len)
    common = {"gpu_memory_gib": gib, "reserve_bytes": budget.reserve, "device_budget_bytes": limit, "prefix": p,
              "continuation_positions": mean_len, "continuation_targets": mean_targets,
              "max_continuations": cfg.packing.max_continuations}
    n, e, s = at(lo)
    if e.total() > limit:
        return {**common, "token_budget": None, "continuations": 0, "estimate_bytes": e.total(),
                "peak_phase": e.peak_phase, "savings": dataclasses.asdict(s)}
    while hi < MAX_POSITIONS and at(hi)[1].total() <= limit:
        lo, hi = hi, min(hi * 2, MAX_POSITIONS)
    if at(hi)[1].total() <= limit:  # the largest budget the config takes fits
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at(mid)[1].total() <= limit else (lo, mid)
    n, e, s = at(lo)
    return {**common, "token_budget": lo, "continuations": n, "estimate_bytes": e.total(), "peak_phase": e.peak_phase,
            "savings": dataclasses.asdict(s)}


def format_budget(b: dict, layers: int) -> str:
    """The largest budget's lines: the budget, its estimate, and the pack and savings it was estimated with."""
    s = StepSavings(**b["savings"])
    head = (f"largest packing.token_budget fitting {b['gpu_memory_gib']:g} GiB per GPU less the "
            f"{b['reserve_bytes'] / GiB:.2f} GiB reserve ({b['device_budget_bytes'] / GiB:.2f} GiB): ")
    if b["token_budget"] is None:
        lines = [f"{head}none", f"  P with one continuation needs {b['estimate_bytes'] / GiB:.2f} GiB"]
    else:
        found = (f"  {b['continuations']} continuations, {b['estimate_bytes'] / GiB:.2f} GiB (peak in "
                 f"{b['peak_phase']})")
        if b["continuations"] > b["max_continuations"]:
            found += f"; needs packing.max_continuations >= {b['continuations']} (now {b['max_continuations']})"
        lines = [f"{head}{b['token_budget']:,} positions", *fit(found)]
    lines += fit(f"  estimated with {describe(s, layers)}")
    lines += fit(f"  P of {b['prefix']:,} tokens and as many continuations as fit, each of the largest pack's mean: "
                 f"{b['continuation_positions']:,.0f} positions, {b['continuation_targets']:,.0f} target tokens")
    return "\n".join(lines)
