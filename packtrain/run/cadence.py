"""What a training run does between its optimizer steps, and when: its cadence.

    before step 1 (or a resumed step):  step 0's evaluations, or those the resumed checkpoint owes
    after each step N:                   each evaluation due at N (the eval loss, then the task), then a checkpoint
    after the last step:                 each evaluation not yet run at it

Each is a component that says when it is due (``due(step)``), what it owes after a resume, and writes its own records:

- :class:`Evaluation`: data.eval's mean loss (under dpo the DPO loss, reward accuracy and margin; under weighted the
  weighted loss too), after each epoch's last step and every ``train.eval_every`` steps; a ``"split": "eval"`` line
  in metrics.jsonl.
- :class:`Generation` (``generate.every``): the task metric on data.eval's answers generated greedily, every
  ``generate.every`` steps; a ``"split": "generate"`` line, and OUTPUT/generations/step-N.jsonl and step-N.errors.md.
- :class:`Checkpoints`: every ``train.save_every`` steps before the last (the final adapter follows the last step),
  pruned to ``train.keep_checkpoints``, and one when a stopped run exits.

Both evaluations also run at step 0 and after the last step, once per step. A run stopped by a signal
(:mod:`packtrain.run.signals`) stops right after a step, before that step's evaluations: its checkpoint's state.json
names those still due (``"owed"``, :meth:`Cadence.owed`), and the resumed run runs them before its first step, as
the uninterrupted run ran them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from tqdm.auto import tqdm

from packtrain import faults
from packtrain.exits import NonFiniteError
from packtrain.run import eval_figures, finite, reference
from packtrain.run.evaluate import evaluate
from packtrain.run.task import describe as describe_task
from packtrain.run.task import run_task, write_task
from packtrain.rundir import checkpoint as ckpt
from packtrain.rundir import directory as rundir


class Records:
    """Where a component's records go: metrics.jsonl (rank 0 writes it), the run's ops (the hang watchdog's beat,
    wandb), a line on the terminal (rank 0), and a progress bar on a terminal."""

    def __init__(self, metrics, ops, info, progress: bool):
        self.metrics, self.ops, self.info, self.progress = metrics, ops, info, progress

    def write(self, record: dict) -> None:
        self.metrics.write(record)
        self.ops.eval_done(record)

    def say(self, line: str) -> None:
        if self.info.is_main:
            tqdm.write(line)

    def bar(self, desc: str, unit: str, beat: str) -> Beating:
        """A progress bar (a terminal only: it would litter logs) whose every update also tells the watchdog that
        ``beat`` is still running (a long evaluation is progress)."""
        bar = tqdm(total=None, desc=desc, unit=unit, leave=False,
                   disable=not (self.info.is_main and self.progress and sys.stderr.isatty()))
        return Beating(bar, lambda: self.ops.progress(beat))


class Beating:
    """A progress bar that also tells the hang watchdog a unit of work finished."""

    def __init__(self, bar, beat):
        self.bar, self.beat = bar, beat

    def update(self, n: int = 1) -> None:
        self.bar.update(n)
        self.beat()

    def close(self) -> None:
        self.bar.close()


class Periodic:
    """An evaluation of the model at some steps: at step 0, at the steps :meth:`falls_on` names, and after the last
    step, once per step. Keeps what it measured for the footer: at step 0 (``first``), last (``last``, at
    ``last_step``)."""
    name: ClassVar[str]  # what state.json's "owed" calls it

    def __init__(self):
        self.owed = False  # the checkpoint resumed from owes it its step (its run stopped before running it)
        self.first: float | None = None
        self.last: float | None = None
        self.last_step: int | None = None

    def falls_on(self, step: int) -> bool:
        raise NotImplementedError

    def measure(self, step: int) -> float | None:
        """Run it on the model as it is after ``step`` steps, write its records; its figure."""
        raise NotImplementedError

    def due(self, step: int) -> bool:
        """Due after optimizer step ``step`` (not run at it yet)."""
        return self.last_step != step and self.falls_on(step)

    def starting(self, step: int) -> bool:
        """Due before the run's first step, ``step`` (0, or the step resumed from): at step 0, or owed."""
        return step == 0 or self.owed

    def ending(self, step: int) -> bool:
        """Due after the last step, ``step``: unless it ran at that step already."""
        return self.last_step != step

    def run(self, step: int) -> float | None:
        value = self.measure(step)
        self.last_step, self.last, self.owed = step, value, False
        if step == 0:
            self.first = value
        return value


class Evaluation(Periodic):
    """data.eval's figures (:mod:`packtrain.run.eval_figures`: the mean per-example loss; under dpo the DPO loss, the
    reward accuracy and margin over its pairs; under weighted the weighted loss too): after each epoch's last step and
    every ``train.eval_every`` steps. Its figure is the loss; ``first_record`` and ``record`` keep the step-0 and the
    latest record for the footer. Under dpo the reference of data.eval (the base model, which training does not
    change) is evaluated once, at the first evaluation, with the adapter disabled, and kept."""
    name = "eval"

    def __init__(self, lm, plan, examples, kinds, records: Records, steps_per_epoch: int, every: int | None):
        super().__init__()
        self.lm, self.plan, self.examples, self.kinds, self.records = lm, plan, examples, kinds, records
        self.steps_per_epoch, self.every = steps_per_epoch, every
        self.reference: dict[str, float] | None = None
        self.first_record: dict | None = None
        self.record: dict | None = None

    def falls_on(self, step):
        return step % self.steps_per_epoch == 0 or bool(self.every and step % self.every == 0)

    def measure(self, step):
        r, info = self.records, self.records.info
        objective = self.kinds.objective
        if objective.paired and self.reference is None:
            bar = r.bar("eval reference", "unit", f"an eval reference unit at step {step} (the evaluation still "
                                                  "running)")
            self.reference = reference.compute(self.lm, self.plan, self.examples, self.kinds, info, bar)
            bar.close()
        bar = r.bar("eval", "unit", f"an eval unit at step {step} (the evaluation still running)")
        rows = evaluate(self.lm, self.plan, self.examples, self.kinds, info, progress=bar)
        bar.close()
        _, summary = eval_figures.figures(objective, rows, self.examples, self.reference)
        loss = summary["loss"]
        if not finite.is_finite(loss):  # the same on every rank: the rows are gathered everywhere
            raise NonFiniteError(f"eval at step {step}: loss {loss!r}; the model has diverged (see the "
                                 "train loss in metrics.jsonl); nothing was saved", quiet=not info.is_main)
        self.record = {"split": "eval", "step": step, **summary}
        if step == 0:
            self.first_record = self.record
        r.write(self.record)
        r.say(f"eval  step {step}: {eval_figures.describe(summary)}")
        return loss


class Generation(Periodic):
    """``generate.every``: the task metric on data.eval (or its first ``generate.examples``), every
    ``generate.every`` steps; rank 0 writes generations/step-N.jsonl and step-N.errors.md. Its figure: the mean
    score."""
    name = "generate"

    def __init__(self, lm, task, kinds, records: Records, out: Path, every: int):
        super().__init__()
        self.lm, self.task, self.kinds, self.records, self.out, self.every = lm, task, kinds, records, out, every

    def falls_on(self, step):
        return step % self.every == 0

    def measure(self, step):
        r, info = self.records, self.records.info
        bar = r.bar("generate", "pack", f"a generation pack at step {step} (the generation still running)")
        result = run_task(self.lm, self.task, self.kinds, info, progress=bar)
        bar.close()
        s = result.summary
        lines = self.out / "generations" / f"step-{step}.jsonl"
        if info.is_main:  # the files first: a metrics line never names generations that were not written
            write_task(result, lines, lines.with_name(f"step-{step}.errors.md"), self.task,
                       f"generations at step {step} of {self.out}")
        r.write({"split": "generate", "step": step, "exact_match": s["exact_match"], "mean_score": s["mean_score"],
                 "examples": s["examples"], "unparsed": s["unparsed"], "tokens": s["tokens"],
                 "tokens_per_second": s["tokens_per_second"]})
        r.say(f"generate step {step}: {describe_task(s)} -> {lines}")
        return s["mean_score"]


class Checkpoints:
    """OUTPUT/checkpoints/step-N: every ``train.save_every`` steps before the last, pruned to
    ``train.keep_checkpoints``. ``state()``: what state.json holds besides the step. ``last``: the newest, written
    or resumed from."""

    def __init__(self, out: Path, every: int, total_steps: int, keep: int | None, parts, state: Callable[[], dict],
                 info, ops, log, last: Path | None = None):
        self.out, self.every, self.total_steps, self.keep = out, every, total_steps, keep
        self.lm, self.model, self.optimizer, self.scheduler, self.params = parts
        self.state, self.info, self.ops, self.log, self.last = state, info, ops, log, last

    def due(self, step: int) -> bool:
        return step % self.every == 0 and step < self.total_steps

    def stopping(self, step: int) -> Path:
        """A stopped run's checkpoint of ``step`` (written unless the newest is it: a run stopped as it resumed)."""
        if self.last is None or self.last.name != f"step-{step}":
            self.save(step)
        return self.last

    def save(self, step: int) -> Path:
        finite.check_parameters(self.params, self.info, step)
        self.last = ckpt.save_checkpoint(self.out, step, self.lm, self.model, self.optimizer, self.scheduler,
                                         self.state(), self.info)
        if self.info.is_main:
            rundir.prune_checkpoints(self.out, self.keep, self.log)
        self.ops.progress(f"checkpoint at step {step}")
        faults.after_checkpoint(step)
        return self.last


class Cadence:
    """A run's components in the order they run after a step: ``evaluations`` (each due one, in order), then
    ``checkpoints``."""

    def __init__(self, evaluations: list[Periodic], checkpoints: Checkpoints):
        self.evaluations, self.checkpoints = evaluations, checkpoints

    def start(self, step: int) -> None:
        """Before the run's first step ``step``: step 0's evaluations, or those the resumed checkpoint owes."""
        for e in self.evaluations:
            if e.starting(step):
                e.run(step)

    def after(self, step: int) -> None:
        """After optimizer step ``step``: the evaluations due, then the checkpoint if due."""
        for e in self.evaluations:
            if e.due(step):
                e.run(step)
        if self.checkpoints.due(step):
            self.checkpoints.save(step)

    def end(self, step: int) -> None:
        """After the last step ``step``: each evaluation not run at it yet."""
        for e in self.evaluations:
            if e.ending(step):
                e.run(step)

    def owed(self, step: int) -> list[str]:
        """The evaluations due after ``step`` and not run yet: what a checkpoint of a run stopped there owes
        (state.json ``"owed"``)."""
        return [e.name for e in self.evaluations if e.due(step)]

    def resume(self, owed: list[str], checkpoint: Path) -> None:
        """Continue from ``checkpoint``, whose state.json owes the evaluations ``owed`` (names of any other are
        ignored: data.eval or generate.every may be gone since)."""
        for e in self.evaluations:
            e.owed = e.name in owed
        self.checkpoints.last = checkpoint

    def get(self, name: str) -> Periodic | None:
        return next((e for e in self.evaluations if e.name == name), None)
