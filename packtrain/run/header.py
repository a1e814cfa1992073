"""What the user reads of a run: the header (data, plan, modes, model, sharding, steps) and the footer (losses and
where the outputs are). Printed by rank 0 only."""

from __future__ import annotations

import json
from pathlib import Path

from packtrain.data.planner import plan_stats
from packtrain.memory import estimate as memory
from packtrain.memory import savings
from packtrain.memory.describe import fit
from packtrain.models import serving
from packtrain.models.lora_compute import describe as describe_lora
from packtrain.packed.families import describe as describe_model
from packtrain.run.balance import BALANCES, epoch_steps, utilisation


def header(trainer) -> list[str]:
    t, cfg = trainer, trainer.cfg
    s = plan_stats(t.plan, t.train_examples)
    lines = [f"packtrain train: {s['examples']} examples, {s['prompts']} prompts -> {s['packs']} packs "
             f"(positions {s['positions_standalone']:,} standalone vs {s['positions_packed']:,} packed, "
             f"{s['position_ratio']:.1f}x)",
             f"  mode {t.kinds.mode}, kernels: {t.backend.describe()}, device {t.info.device}, "
             f"world size {t.info.world_size}, dtype {cfg.model.dtype}",
             f"  {describe_model(t.model)}",
             f"  context_grad {t.lm.context.describe()}",
             f"  loss: {t.lm.describe_loss()}",
             f"  objective {t.kinds.objective.describe()}"]
    lora = describe_lora(t.model)
    if lora is not None:
        lines.append(f"  {lora}")
        lines.append(f"  {serving.describe(serving.of_lora(cfg.lora))}")
    if t.kinds.objective.paired:
        lines.append(f"  {s['examples'] // 2:,} preference pairs, each pair's two answers in one pack")
    if t.kinds.objective.online:
        r = cfg.rl
        lines.append(f"  online: each step samples {r.num_generations} completions of up to "
                     f"{r.max_completion_length} tokens per request (temperature {r.temperature:g}, top_p "
                     f"{r.top_p:g}), scored by {cfg.generate.metric} against its target; samples and rewards in "
                     f"{t.out / 'rollouts'}/step-N.jsonl (the figures above are the requests with their targets)")
    if cfg.data.train_on != "last" or s["turns"] != s["examples"]:
        lines.append(f"  data.train_on {cfg.data.train_on}: {s['conversations']:,} conversations, {s['turns']:,} "
                     f"assistant turns trained, {s['target_tokens']:,} target tokens")
    steps = t.steps
    figures = {b: utilisation(epoch_steps(t.plan, steps.costs, 0, steps.seed, steps.per_step, steps.world, b),
                              steps.costs) for b in BALANCES}
    other = next(b for b in BALANCES if b != steps.balance)
    lines.append(f"  train.balance {steps.balance}: utilisation {figures[steps.balance]:.3f} over epoch 0's steps "
                 f"({other} {figures[other]:.3f}; mean / largest rank cost per step)")
    lines += [f"  {line}" for line in t.kinds.runs(s)]
    if t.info.enabled:
        local = sum(getattr(p, "_local_tensor", p).numel() for p in t.lm.parameters())
        total = sum(p.numel() for p in t.lm.parameters())
        lines.append(f"  FSDP2 over {t.info.world_size} ranks: rank 0 holds {local:,} of {total:,} parameter "
                     "elements")
    report = getattr(t.lm, "load_report", None)
    if report is not None:
        lines.append(f"  weights: {report.describe()}")
    if t.task is not None:
        g = cfg.generate
        lines.append(f"  generate: every {g.every} steps (and at step 0 and the end) on {len(t.task.examples)} "
                     f"examples of data.eval, metric {g.metric}, up to {g.max_new_tokens} new tokens; predictions "
                     f"in {t.out / 'generations'}/step-N.jsonl, mismatches in step-N.errors.md")
    lines += memory_lines(t)
    trainable = sum(p.numel() for p in t.params)
    lines.append(f"  {t.total_steps} step{'s' * (t.total_steps != 1)} ({t.steps_per_epoch} per epoch, "
                 f"{packs_per_step(cfg, t.info.world_size)}"
                 f"), {trainable:,} trainable parameters, output {t.out}")
    if t.idle_warning is not None:
        lines.append(f"  {t.idle_warning}")
    given = t.overrides.describe()
    if given is not None:
        lines.append(f"  {given}")
    return [part for line in lines for part in fit(line)]  # a terminal's 120 columns


def packs_per_step(cfg, world: int) -> str:
    """``2 packs per step (1 per rank)``, or ``1 pack per step`` at one rank."""
    n = cfg.packs_per_step(world)
    per_rank = f" ({cfg.train.packs_per_rank} per rank)" if cfg.train.packs_per_step is None and world > 1 else ""
    return f"{n} pack{'s' * (n != 1)} per step{per_rank}"


def _at_step_0(metrics_path, split: str, key: str) -> float | None:
    """``key`` of the step-0 ``split`` line of metrics.jsonl: what a resumed run evaluated before it stopped."""
    try:
        text = Path(metrics_path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("split") == split and rec.get("step") == 0:
            return rec.get(key)
    return None


def memory_lines(t) -> list[str]:
    """The memory savings chosen for the largest unit (every candidate considered, the chosen one marked), the
    estimate's peak, and a warning when the choice does not fit (packtrain/memory/savings.py)."""
    return savings_lines(t.savings)


def savings_lines(choice) -> list[str]:
    """A choice's lines as the run header prints them (train, smoke, bench)."""
    c = choice.chosen
    first = (f"  memory: {savings.describe(c.savings, choice.layers)}: about {c.device_bytes / memory.GiB:.1f} GiB "
             f"{'per GPU' if choice.budget.device == 'cuda' else 'per rank'} at the largest unit (the estimate, peak "
             f"in {c.peak_phase}), step cost {c.relative_cost:.3f} "
             "of the step without savings")
    lines = [first]
    lines += [f"  {line}" for line in choice.lines()]
    warning = choice.warning()
    if warning is not None:
        lines.append(f"  {warning}")
    return lines


def footer(summary: dict, metrics_path) -> list[str]:
    """The eval loss (under dpo also the reward accuracy on data.eval's pairs) and task score from step 0 to the end (a resumed run's step 0 read back from metrics.jsonl:
    its lines were dropped from the footer before), then where the outputs are."""
    lines = []
    before = summary["eval_before"] if summary["eval_before"] is not None else _at_step_0(metrics_path, "eval", "loss")
    if before is not None and summary["eval_after"] is not None:
        lines.append(f"eval loss: {before:.4f} at step 0 -> {summary['eval_after']:.4f} "
                     f"at step {summary['eval_after_step']}")
    accuracy = summary.get("reward_accuracy_before")
    accuracy = accuracy if accuracy is not None else _at_step_0(metrics_path, "eval", "reward_accuracy")
    if accuracy is not None and summary.get("reward_accuracy_after") is not None:
        lines.append(f"reward accuracy: {accuracy:.2f} at step 0 -> {summary['reward_accuracy_after']:.2f} "
                     f"at step {summary['eval_after_step']}")
    task = summary.get("task_before")
    task = task if task is not None else _at_step_0(metrics_path, "generate", "mean_score")
    if task is not None and summary.get("task_after") is not None:
        lines.append(f"task score: {task:.4f} at step 0 -> {summary['task_after']:.4f} "
                     f"at step {summary['task_after_step']}")
    return lines + [f"adapter: {summary['adapter']}", f"loss plot: {summary['plot']}", f"metrics: {metrics_path}"]
