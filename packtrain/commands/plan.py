"""`packtrain plan CONFIG [--set ...] [--json] [--world-size N] [--memory]`: plan the training data's packs and
print the statistics, the steps' utilisation at N ranks under both ``train.balance`` settings
(:mod:`packtrain.run.balance`); with ``--memory``, the memory savings chosen for the largest pack (the candidates
considered, :mod:`packtrain.memory.savings`) and its per-GPU memory estimate (:mod:`packtrain.memory.estimate`), and
with ``--gpu-memory GIB`` the choice for that GPU and the largest budget that fits it. Every line of the output fits
120 columns (:data:`packtrain.memory.describe.WIDTH`).

``--memory`` needs no data: without ``data.train`` (not set, or no such file) it sizes the pack of the most memory
the config allows (:func:`budget_shapes`) and says so; plain ``plan`` reads and plans the data, with the checks train
makes of it (the task metric's too, under ``generate.every``).

Nothing touches torch or a model: this is how to size ``packing.token_budget`` before a run. ``--measure`` is the
exception: it runs the training step under fake tensors (:mod:`packtrain.memory.measure`), seconds and no memory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from packtrain.config import ConfigError, built_context_grads, load_config
from packtrain.data.planner import plan_stats
from packtrain.memory import describe as memory_report
from packtrain.memory import estimate as memory
from packtrain.memory import savings
from packtrain.memory.budget import format_node_pool, node_pool, plan_budget
from packtrain.memory.describe import fit
from packtrain.memory.estimate import UnitShape
from packtrain.models import serving
from packtrain.models.cost import CostModel
from packtrain.run import balance
from packtrain.run.session import data_free_kinds, open_session
from packtrain.run.units import Kinds, unit_shape


def _shown(path: Path) -> Path:
    """Relative to the working directory when it is below it, else absolute."""
    path = path.resolve()
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def format_table(stats: dict, title: str) -> str:
    s = stats
    skipped = f"  ({s['skipped']:,} skipped: over the token budget)" if s["skipped"] else ""
    per_pack = f"min {s['continuations_min']}, median {s['continuations_median']}, max {s['continuations_max']}"
    rows = [
        ("positions", s["positions_standalone"], s["positions_packed"], s["position_ratio"]),
        ("attention pairs", s["attention_pairs_standalone"], s["attention_pairs_packed"], s["attention_pair_ratio"]),
    ]
    width = max(len("standalone"), *(len(f"{r[1]:,}") for r in rows)) + 2
    lines = [
        title,
        f"  examples   {s['examples']:,}{skipped}",
        (f"  data       {s['conversations']:,} conversation{'s' * (s['conversations'] != 1)}, {s['turns']:,} "
         f"assistant turn{'s' * (s['turns'] != 1)} trained, {s['target_tokens']:,} target tokens"),
        *(fit(f"  tokens     {s['whole_differs']:,} example{'s' * (s['whole_differs'] != 1)} tokenized as "
              f"generated (prompt, then target) differ{'s' * (s['whole_differs'] == 1)} from the whole render "
              "tokenized at once",
              " " * 13) if s["whole_differs"] else []),
        *([f"  pairs      {s['preference_pairs']:,} preference pairs, each pair's two answers in one pack"]
          if s.get("preference_pairs") else []),
        *([f"  groups     {s['scored_groups']:,} scored groups, each group's completions in one pack"]
          if s.get("scored_groups") else []),
        *([f"  weights    {s['weighted']:,} example{'s' * (s['weighted'] != 1)} weighted other than 1"]
          if s.get("weighted") else []),
        f"  prompts    {s['prompts']:,}",
        f"  packs      {s['packs']:,}  (continuations per pack: {per_pack})",
        f"  budget     {s['token_budget']:,} positions per pack, {s['budget_utilisation']:.1%} used",
        *([f"  walked     {s['walked']:,} examples over the budget, in {s['walk_chunks']:,} chunks"]
          if s.get("walked") else []),
        "",
    ]
    if "positions_shared_prefix" in s:
        lines += _mode_rows(s)
    else:
        lines.append(f"  {'':<17}{'standalone':>{width}}{'packed':>{width}}{'ratio':>9}")
        for name, standalone, packed, ratio in rows:
            lines.append(f"  {name:<17}{standalone:>{width},}{packed:>{width},}{ratio:>8.1f}x")
    lines.append("  (attention pairs: query-key pairs of causal attention, per full-attention layer and head)")
    return "\n".join(lines)


def _mode_rows(s: dict) -> list[str]:
    """A tree plan's rows: standalone, shared_prefix (the same examples packed flat) and tree, each with its
    positions and attention pairs and their ratio over the tree's."""
    rows = [("standalone", s["positions_standalone"], s["attention_pairs_standalone"]),
            ("shared_prefix", s["positions_shared_prefix"], s["attention_pairs_shared_prefix"]),
            ("tree", s["positions_packed"], s["attention_pairs_packed"])]
    pos = max(len("positions"), *(len(f"{r[1]:,}") for r in rows)) + 2
    pairs = max(len("attention pairs"), *(len(f"{r[2]:,}") for r in rows)) + 2
    lines = [f"  {'':<17}{'positions':>{pos}}{'vs tree':>9}{'attention pairs':>{pairs}}{'vs tree':>9}"]
    for name, positions, n_pairs in rows:
        lines.append(f"  {name:<17}{positions:>{pos},}{positions / s['positions_packed']:>8.1f}x"
                     f"{n_pairs:>{pairs},}{n_pairs / s['attention_pairs_packed']:>8.1f}x")
    return lines


def step_figures(cfg, plan, examples, world: int) -> dict:
    """Epoch 0's steps at ``world`` ranks under ``train.balance`` (``schedule``: steps -> ranks -> pack indices),
    each pack's positions, attention pairs and cost, and both balances' utilisation and distinct prompts per step."""
    model = CostModel.for_config(cfg)
    costs = balance.pack_costs(plan, examples, model)
    t, per_step = cfg.train, cfg.packs_per_step(world)
    figures = {}
    for name in balance.BALANCES:
        sched = balance.epoch_steps(plan, costs, 0, t.seed, per_step, world, name)
        figures[name] = {"utilisation": balance.utilisation(sched, costs),
                         "distinct_prompts_per_step": balance.distinct_prompts(sched, plan), "schedule": sched}
    return {"world_size": world, "packs_per_step": per_step, "balance": t.balance,
            "idle_ranks": balance.idle_ranks(cfg, world),
            "cost_model": {"per_position": model.per_position, "per_pair": model.per_pair},
            "utilisation": {name: f["utilisation"] for name, f in figures.items()},
            "distinct_prompts_per_step": {name: f["distinct_prompts_per_step"] for name, f in figures.items()},
            "schedule": figures[t.balance]["schedule"],
            "pack_positions": [p.positions for p in plan.packs],
            "pack_attention_pairs": balance.pack_attention_pairs(plan, examples), "pack_cost": costs}


def format_steps(f: dict) -> str:
    u, d = f["utilisation"], f["distinct_prompts_per_step"]
    per = f"{f['packs_per_step']} pack{'s' * (f['packs_per_step'] != 1)} per step"
    lines = [f"steps at world size {f['world_size']} ({per}; train.balance {f['balance']})",
             (f"  utilisation (mean / largest rank cost per step, epoch 0) cost {u['cost']:.3f}, "
              f"round_robin {u['round_robin']:.3f}"),
             f"  distinct prompts per step: cost {d['cost']:.1f}, round_robin {d['round_robin']:.1f}",
             *fit(f"  cost model: {f['cost_model']['per_position']:.3g} per position + "
                  f"{f['cost_model']['per_pair']:.3g} per attention pair (train.cost_per_position, "
                  "train.cost_per_pair)")]
    if f["idle_ranks"] is not None:  # what train warns about too
        lines += fit(f"  {f['idle_ranks']}")
    return "\n".join(lines)


def budget_shapes(cfg, kinds: Kinds) -> list[UnitShape]:
    """The units of the most memory the config allows, what ``plan --memory`` sizes without data:
    ``packing.token_budget`` positions (at most ``train.max_positions``), every continuation position a target. The
    estimate grows with a unit's positions and its targets; where P is no graph of its own (a whole pack, a tree, an
    example alone) a position of P holds at most what a continuation's target does, so the most is no P and
    ``packing.max_continuations`` continuations of equal length (one example where the kind shares no P). Continuation
    groups keep P's graph whole while each group runs: there a P of all but one position per continuation may hold
    more, and both shapes are returned."""
    p = cfg.packing
    positions = min(p.token_budget, cfg.train.max_positions or p.token_budget)
    n = min(p.max_continuations, positions) if kinds.pack.shares_prefix else 1
    lengths = [positions // n + (i < positions % n) for i in range(n)]
    shapes = [UnitShape(0, lengths, list(lengths), kinds.pack.group_positions(lengths), kinds.pack.shares_prefix)]
    if kinds.n_groups > 1 and positions > n:
        ones = [1] * n
        shapes.append(UnitShape(positions - n, ones, ones, kinds.pack.group_positions(ones)))
    return shapes


def _hardest(cfg, args, shapes: list[UnitShape]) -> UnitShape:
    """The shape whose savings are hardest to choose: one that does not fit, else the costliest step, else the most
    memory."""
    limits = plan_budget(cfg, args.world_size, args.gpu_memory, args.ranks_per_node, args.host_memory_per_node)

    def hardness(shape):
        c = savings.choose(cfg, shape, args.world_size, limits).chosen
        return not c.fits, c.relative_cost, c.device_bytes

    return max(shapes, key=hardness)


def _no_data(cfg) -> str | None:
    """Why ``data.train`` cannot be read (not set, no such file); None when it is there."""
    if cfg.data.train is None:
        return "data.train not set"
    path = cfg.resolve_path(cfg.data.train)
    return None if path.exists() else f"{_shown(path)} not found"


@dataclasses.dataclass
class MemoryReport:
    """What ``--memory`` prints of the largest unit: the savings chosen, their estimate and what comes with it."""
    shape: UnitShape
    choice: savings.Choice
    measured: object = None  # --measure's count (packtrain.memory.measure.WholeModel)
    budget: dict | None = None  # --gpu-memory's largest budget
    pool: dict | None = None  # the offload pools of a node
    modes: dict | None = None  # each packing.context_grad the packing mode builds -> its estimate

    def as_json(self, no_data: str | None) -> dict:
        c, est = self.choice.chosen, self.choice.estimate
        s = self.shape
        out = {"terms": [dataclasses.asdict(t) for t in est.terms],
               "total_device_bytes": est.total("device"), "total_host_bytes": est.total("host"),
               "phases": est.phases, "peak_phase": est.peak_phase,
               "savings": dataclasses.asdict(c.savings), "relative_step_cost": c.relative_cost,
               "device_budget_bytes": self.choice.budget.device_bytes, "fits": c.fits,
               "choice": self.choice.as_json(), "node": self.pool,
               "unit": {"from": "data" if no_data is None else "packing.token_budget", "no_data": no_data,
                        "prefix": s.prefix, "positions": s.prefix + sum(s.lengths),
                        "continuations": s.continuations, "target_tokens": sum(s.targets)}}
        if self.measured is not None:
            out["measured"] = self.measured.as_json()
        if self.budget is not None:
            out["max_token_budget"] = self.budget["token_budget"]
            out["budget_search"] = self.budget
        if self.modes is not None:
            out["context_grad"] = {m: {"total_device_bytes": e.total("device"),
                                       "terms": [dataclasses.asdict(t) for t in e.terms]}
                                   for m, e in self.modes.items()}
        return out

    def lines(self) -> list[str]:
        choice = self.choice
        lines = ["", *choice.lines()]
        if choice.warning():
            lines += fit(choice.warning())
        lines += ["", memory_report.format_table(choice.estimate),
                  memory_report.format_phases(choice.estimate, self.measured)]
        if self.budget is not None:
            lines.append(savings.format_budget(self.budget, choice.layers))
        if self.pool is not None:
            lines += fit(format_node_pool(self.pool))
        if self.modes is not None:
            lines += ["", memory_report.format_modes(self.modes)]
        return lines


def memory_report_for(cfg, args, shape: UnitShape, measure=None) -> MemoryReport:
    """The savings chosen for the unit of ``shape`` within ``args``' budget, and what ``args`` asks beside them;
    ``measure(chosen_cfg)``: --measure's count of the step under the chosen savings."""
    limits = plan_budget(cfg, args.world_size, args.gpu_memory, args.ranks_per_node, args.host_memory_per_node)
    choice = savings.choose(cfg, shape, args.world_size, limits)
    chosen = choice.apply(cfg)
    report = MemoryReport(shape, choice)
    if measure is not None:
        report.measured = measure(chosen)
    if args.gpu_memory is not None:
        report.budget = savings.max_token_budget(cfg, shape, args.world_size, limits, args.gpu_memory)
    # the modes the packing mode builds (tree: full alone, the estimate above: no table)
    context_grads = built_context_grads(cfg.packing)
    if shape.shares_prefix and len(context_grads) > 1:
        report.modes = {m: memory.estimate_for_unit(chosen, shape, args.world_size, m) for m in context_grads}
    if choice.chosen.savings.offload_layers:
        report.pool = node_pool(choice.estimate.total("host"), limits.ranks_per_node, limits.host_per_node)
    return report


def run_plan(args) -> int:
    if args.world_size is not None and args.ranks_per_node is not None and args.ranks_per_node > args.world_size:
        raise ValueError(f"--ranks-per-node {args.ranks_per_node}: more than the run's --world-size "
                         f"{args.world_size} ranks (a node holds at most all of them)")
    args.world_size = args.world_size or 1
    cfg = load_config(args.config, args.overrides)
    args.memory = args.memory or args.measure or args.gpu_memory is not None
    no_data = _no_data(cfg)
    if no_data is not None and args.memory:
        return _plan_memory_alone(cfg, args, no_data)
    if cfg.data.train is None:
        raise ConfigError(["data.train: not set (the training data to plan)"], args.config)
    # the run's setup (packtrain/run/session.py) without a process group or a model: the checks train makes of the
    # data and of generate.metric, and its plan
    session = open_session(cfg, None, "train", savings=False, model=args.memory, task=cfg.generate.every is not None)
    examples, plan = session.examples, session.plan
    stats = plan_stats(plan, examples)
    steps = step_figures(cfg, plan, examples, args.world_size)
    online = None
    if session.kinds.objective.online:  # rl.num_generations: the samples' packs, each step's (at most)
        from packtrain.run.balance import StepPlan
        from packtrain.run.rollouts import check_room, epoch_positions

        check_room(cfg, session.kinds, plan, examples)
        online = epoch_positions(cfg, session.kinds, plan, examples,
                                 StepPlan.for_run(cfg, plan, examples, args.world_size))
        stats["online"] = online
    report = None
    if args.memory:
        measure = None
        if args.measure:
            from packtrain.memory.measure import measure_whole
            from packtrain.run.harness import measure_step

            def measure(chosen):
                return measure_whole(chosen, measure_step(chosen, plan, examples, session.kinds), args.world_size)
        report = memory_report_for(cfg, args, unit_shape(cfg, plan, examples, session.kinds), measure)
    serve = serving.of_lora(cfg.lora)
    if args.json:
        stats.update(steps)
        stats["serve"] = serving.as_json(serve)
        if report is not None:
            stats["memory"] = report.as_json(None)
        print(json.dumps(stats, allow_nan=False))  # JSON has no NaN: the flags and config are finite
        return 0
    print(format_table(stats, f"plan for {_shown(cfg.resolve_path(cfg.data.train))}"))
    if online is not None:
        from packtrain.run.rollouts import describe_positions

        print("\n".join(fit("  " + describe_positions(online, cfg.packing.mode), " " * 13)))
    print()
    print(format_steps(steps))
    print("\n".join(fit(serving.describe(serve))))
    if report is not None:
        print("\n".join(report.lines()))
    return 0


def _plan_memory_alone(cfg, args, no_data: str) -> int:
    """``plan --memory`` without data: the pack of the most memory the config allows (:func:`budget_shapes`) sized,
    after the checks that need no data (the model family, generate.metric: the session's)."""
    if args.measure:
        raise ValueError(f"--measure runs the training step on the data's largest pack: no data ({no_data})")
    report = memory_report_for(cfg, args, _hardest(cfg, args, budget_shapes(cfg, data_free_kinds(cfg))))
    serve = serving.of_lora(cfg.lora)
    if args.json:
        print(json.dumps({"data": None, "serve": serving.as_json(serve), "memory": report.as_json(no_data)},
                         allow_nan=False))
        return 0
    print("\n".join(fit(f"no data ({no_data}): estimating the pack of packing.token_budget positions that needs the "
                         "most memory")))
    print("\n".join(fit(serving.describe(serve))))
    print("\n".join(report.lines()))
    return 0
