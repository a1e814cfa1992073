"""`packtrain smoke CONFIG`: two optimizer updates on the largest pack of the plan, then a checkpoint save, with the
peak memory of each phase.

Why two updates and a save: AdamW creates its moment tensors during the first update, so only the second backward
runs with them in memory, and a save has its own memory pattern; a one-update test sees neither peak.
Writes to OUTPUT/smoke/ (never OUTPUT/checkpoints/, which ``train --resume`` reads). On out-of-memory it prints the
phases so far and exits 3 naming the phase. Under the training launcher every rank runs the same pack, sharded as
in training, and the table shows each phase's largest peak and its rank (an out-of-memory rank leaves the others
waiting in a collective until the launcher's timeout; its own output names the phase).
"""

from __future__ import annotations

import sys

from packtrain.config import load_config
from packtrain.distributed import apply_launcher_settings, init_distributed, shutdown
from packtrain.ops.nodes import gather_objects

OUT_OF_MEMORY_EXIT = 3


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def worst_over_ranks(per_rank: list[list]) -> list[tuple[object, int]]:
    """[(phase with the largest peak allocated, its rank)] per phase, from every rank's phases."""
    return [max(((phases[i], r) for r, phases in enumerate(per_rank)), key=lambda pr: pr[0].allocated or 0)
            for i in range(len(per_rank[0]))]


def format_table(title: str, phases, cuda: bool, since_start: bool, ranks: list[int] | None = None) -> str:
    heads = ("peak allocated GiB", "peak reserved GiB") if cuda else ("peak RSS GiB",)
    lines = [title, f"  {'phase':<34}" + "".join(f"{h:>20}" for h in heads) + f"{'seconds':>10}"
             + ("  rank" if ranks else "")]
    for i, p in enumerate(phases):
        values = (p.allocated, p.reserved) if cuda else (p.allocated,)
        row = f"  {p.name:<34}" + "".join(f"{_gib(v):>20}" for v in values) + f"{p.seconds:>10.1f}"
        row += f"  {ranks[i]:>4}" if ranks else ""
        lines.append(row + (f"   {p.error}" if p.error else ""))
    if since_start:
        lines.append("  (this system does not reset the peak RSS: each figure is the peak since the process started)")
    return "\n".join(lines)


def run_smoke(args) -> int:
    from packtrain.data.planner import target_count
    from packtrain.run import harness
    from packtrain.run.header import savings_lines
    from packtrain.run.session import open_session
    from packtrain.rundir import checkpoint as ckpt

    cfg = load_config(args.config, args.overrides)
    apply_launcher_settings(cfg)  # accelerate's own config, where packtrain has an equivalent
    info = init_distributed(cfg.train.device, cfg.ops.collective_timeout)
    # the run's setup (packtrain/run/session.py): the savings train would take on this device, said before anything
    # runs; the largest unit as the trainer runs it (in continuation groups, walked)
    session = open_session(cfg, info, "train")
    plan, examples = session.plan, session.examples
    if info.is_main:
        print("\n".join(savings_lines(session.choice)))
    cfg = session.run_cfg
    one, unit = harness.one_pack(plan, examples, session.kinds, cfg.train.max_positions)
    out = cfg.output_path / "smoke"
    probe = harness.PeakMemory(info.device)
    phases = []
    state = {}

    def load():
        session.build_model()  # the step's build loads the pack's images (a vision-language model's), as train's
        state["step"] = harness.update_step(cfg, session.lm, session.kinds, one, examples, info)
        state["updates"] = 0

    def update():
        harness.one_update(state["step"], state["updates"])
        state["updates"] += 1

    def save():
        step = state["step"]
        ckpt.save_checkpoint(out, 2, session.lm, session.model, step.optimizer, step.scheduler, {"smoke": True},
                             info)

    targets = sum(target_count(examples[e]) for e in unit.examples)
    title = (f"smoke: the largest {unit.kind.describe(unit)}, {one.packs[0].positions:,} positions "
             f"({len(unit.examples)} continuations{unit.kind.detail(unit)}, {targets:,} target tokens), "
             f"device {info.device}, {cfg.model.dtype}")
    try:
        harness.run_phase(phases, probe, "load model", load)
        harness.run_phase(phases, probe, "update 1", update)
        harness.run_phase(phases, probe, "update 2 (with optimizer state)", update)
        harness.run_phase(phases, probe, "save checkpoint", save)
        per_rank = gather_objects(phases, info)
    except BaseException as e:
        if not harness.is_out_of_memory(e):
            raise
        print(format_table(title + f" (rank {info.rank})", phases, probe.cuda, probe.since_start))
        print(f"packtrain smoke: out of memory in phase '{phases[-1].name}' on rank {info.rank}", file=sys.stderr)
        return OUT_OF_MEMORY_EXIT
    finally:
        shutdown()
    if info.is_main:
        worst = worst_over_ranks(per_rank)
        print(format_table(f"{title}, kernels {session.backend.describe()}, world size {info.world_size}",
                           [p for p, _ in worst], probe.cuda, probe.since_start,
                           [r for _, r in worst] if info.enabled else None))
        print(f"checkpoint: {out / 'checkpoints' / 'step-2'}")
    return 0
