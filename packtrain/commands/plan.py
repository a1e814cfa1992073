"""`packtrain plan CONFIG [--set ...] [--json] [--world-size N] [--memory]`: plan the training data's packs and
print the statistics, the steps' utilisation at N ranks under both ``train.balance`` settings
(:mod:`packtrain.run.balance`); with ``--memory``, the memory savings chosen for the largest pack (the candidates
considered, :mod:`packtrain.memory.savings`) and its per-GPU memory estimate (:mod:`packtrain.memory.estimate`), and
with ``--gpu-memory GIB`` the choice for that GPU and the largest budget that fits it.

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
from packtrain.models import serving
from packtrain.models.cost import CostModel
from packtrain.run import balance
from packtrain.run.session import open_session
from packtrain.run.units import unit_shape


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
        *([(f"  tokens     {s['whole_differs']:,} example{'s' * (s['whole_differs'] != 1)} tokenized as generated "
            "(the prompt, then the target apart) differ from the whole render tokenized at once")]
          if s["whole_differs"] else []),
        *([f"  pairs      {s['preference_pairs']:,} preference pairs, each pair's two answers in one pack"]
          if s.get("preference_pairs") else []),
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
    t = cfg.train
    figures = {}
    for name in balance.BALANCES:
        sched = balance.epoch_steps(plan, costs, 0, t.seed, t.packs_per_step, world, name)
        figures[name] = {"utilisation": balance.utilisation(sched, costs),
                         "distinct_prompts_per_step": balance.distinct_prompts(sched, plan), "schedule": sched}
    return {"world_size": world, "packs_per_step": t.packs_per_step, "balance": t.balance,
            "cost_model": {"per_position": model.per_position, "per_pair": model.per_pair},
            "utilisation": {name: f["utilisation"] for name, f in figures.items()},
            "distinct_prompts_per_step": {name: f["distinct_prompts_per_step"] for name, f in figures.items()},
            "schedule": figures[t.balance]["schedule"],
            "pack_positions": [p.positions for p in plan.packs],
            "pack_attention_pairs": balance.pack_attention_pairs(plan, examples), "pack_cost": costs}


def format_steps(f: dict) -> str:
    u, d = f["utilisation"], f["distinct_prompts_per_step"]
    per = f"{f['packs_per_step']} pack{'s' * (f['packs_per_step'] != 1)} per step"
    lines = [(f"steps at world size {f['world_size']} ({per}; train.balance "
              f"{f['balance']}): utilisation (mean / largest rank cost per step, epoch 0) cost {u['cost']:.3f}, "
              f"round_robin {u['round_robin']:.3f}; distinct prompts per step {d['cost']:.1f} vs "
              f"{d['round_robin']:.1f}"),
             (f"  cost model: {f['cost_model']['per_position']:.3g} per position + "
              f"{f['cost_model']['per_pair']:.3g} per attention pair (train.cost_per_position, train.cost_per_pair)")]
    if f["packs_per_step"] < f["world_size"]:
        lines.append(f"  train.packs_per_step {f['packs_per_step']} < {f['world_size']} ranks: most ranks run dummy "
                     "units every step")
    return "\n".join(lines)


def run_plan(args) -> int:
    if args.world_size is not None and args.ranks_per_node is not None and args.ranks_per_node > args.world_size:
        raise ValueError(f"--ranks-per-node {args.ranks_per_node}: more than the run's --world-size "
                         f"{args.world_size} ranks (a node holds at most all of them)")
    args.world_size = args.world_size or 1
    cfg = load_config(args.config, args.overrides)
    if cfg.data.train is None:
        raise ConfigError(["data.train: not set (the training data to plan)"], args.config)
    args.memory = args.memory or args.measure or args.gpu_memory is not None
    # the run's setup (packtrain/run/session.py) without a process group or a model: the checks train makes of the
    # data, and its plan
    session = open_session(cfg, None, "train", savings=False, model=args.memory)
    examples, plan = session.examples, session.plan
    stats = plan_stats(plan, examples)
    steps = step_figures(cfg, plan, examples, args.world_size)
    shape = unit_shape(cfg, plan, examples, session.kinds) if args.memory else None
    choice = est = measured = budget = pool = modes = None
    if args.memory:
        limits = plan_budget(cfg, args.world_size, args.gpu_memory, args.ranks_per_node,
                                     args.host_memory_per_node)
        choice = savings.choose(cfg, shape, args.world_size, limits)
        chosen = choice.apply(cfg)
        est = choice.estimate
        if args.measure:
            from packtrain.memory.measure import measure_whole
            from packtrain.run.harness import measure_step

            measured = measure_whole(chosen, measure_step(chosen, plan, examples, session.kinds), args.world_size)
        if args.gpu_memory is not None:
            budget = savings.max_token_budget(cfg, shape, args.world_size, limits, args.gpu_memory)
        # the modes the packing mode builds (tree: full alone, the estimate above: no table)
        context_grads = built_context_grads(cfg.packing)
        if shape.shares_prefix and len(context_grads) > 1:
            modes = {m: memory.estimate_for_unit(chosen, shape, args.world_size, m) for m in context_grads}
        if choice.chosen.savings.offload_layers:
            pool = node_pool(est.total("host"), limits.ranks_per_node, limits.host_per_node)
    serve = serving.of_lora(cfg.lora)
    if args.json:
        stats.update(steps)
        stats["serve"] = serving.as_json(serve)
        if est is not None:
            c = choice.chosen
            stats["memory"] = {"terms": [dataclasses.asdict(t) for t in est.terms],
                               "total_device_bytes": est.total("device"), "total_host_bytes": est.total("host"),
                               "phases": est.phases, "peak_phase": est.peak_phase,
                               "savings": dataclasses.asdict(c.savings), "relative_step_cost": c.relative_cost,
                               "device_budget_bytes": choice.budget.device_bytes, "fits": c.fits,
                               "choice": choice.as_json(), "node": pool}
            if measured is not None:
                stats["memory"]["measured"] = measured.as_json()
            if budget is not None:
                stats["memory"]["max_token_budget"] = budget["token_budget"]
                stats["memory"]["budget_search"] = budget
        if modes is not None:
            stats["memory"]["context_grad"] = {m: {"total_device_bytes": e.total("device"),
                                                   "terms": [dataclasses.asdict(t) for t in e.terms]}
                                               for m, e in modes.items()}
        print(json.dumps(stats, allow_nan=False))  # JSON has no NaN: the flags and config are finite
        return 0
    print(format_table(stats, f"plan for {_shown(cfg.resolve_path(cfg.data.train))}"))
    print()
    print(format_steps(steps))
    print(serving.describe(serve))
    if est is not None:
        print()
        print("\n".join(choice.lines()))
        if choice.warning():
            print(choice.warning())
        print()
        print(memory_report.format_table(est))
        print(memory_report.format_phases(est, measured))
        if budget is not None:
            print(savings.format_budget(budget, choice.layers))
        if pool is not None:
            print(format_node_pool(pool))
    if modes is not None:
        print()
        print(memory_report.format_modes(modes))
    return 0
