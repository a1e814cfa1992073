"""The training run, top to bottom: setup -> (step, log, its cadence)* -> final adapter.

    examples -> planner -> packs -> per-rank units -> unit runner -> loss -> backward -> AdamW/SGD

An optimizer step takes ``train.packs_per_rank`` packs on every rank (or ``train.packs_per_step`` over all ranks).
Each unit's ``loss_sum`` (sum of per-example mean target cross-entropies) is scaled by 1 / (examples in the whole
step) and FSDP sums the ranks' gradients, so the update is the mean of per-example losses whatever the split into
packs, micro-steps, modes or ranks (:func:`packtrain.run.units.step_scale`). The step itself is
:class:`packtrain.run.step.Step`, the one the bench and the harness run too; the units run in
:mod:`packtrain.run.units`. What runs between steps (evaluation, task
generation, checkpoints) and when is the run's cadence, :mod:`packtrain.run.cadence`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from packtrain.config import Config
from packtrain.data.planner import plan_fingerprint, weights_fingerprint
from packtrain.distributed import DistInfo, agree, barrier, init_distributed, lost_peer
from packtrain.exits import NonFiniteError, PeerLost, Preempted
from packtrain.memory.describe import fit
from packtrain.ops.nodes import check_same_config, check_same_plan
from packtrain.ops.runtime import RunOps
from packtrain.run import balance, finite, reference, rollouts
from packtrain.run.balance import StepPlan
from packtrain.run.cadence import Beating, Cadence, Checkpoints, Evaluation, Generation, Records
from packtrain.run.header import footer, header
from packtrain.run.metrics import MetricsLog, peak_memory_bytes, plot_losses
from packtrain.run.objective import Sft
from packtrain.run.optim import build_optimizer, build_scheduler
from packtrain.run.progress import Progress
from packtrain.run.session import open_session
from packtrain.run.signals import StopSignals
from packtrain.run.step import Step
from packtrain.run.units import unit_shape
from packtrain.rundir import checkpoint as ckpt
from packtrain.rundir import directory as rundir
from packtrain.rundir import overrides
from packtrain.rundir import resume as resuming
from packtrain.rundir.overrides import RunOverrides
from packtrain.rundir.tokenizer import save_run_tokenizer


def check_node_pool(cfg, plan, examples, world_size: int, kinds) -> None:
    """Refuse a run whose offload pools (this node's ranks: LOCAL_WORLD_SIZE) would not fit the node's host memory
    (``ops.host_memory_per_node_gib``, else MemAvailable now), before the model is built. ``cfg``: the savings
    chosen (an auto ``train.offload`` is chosen to fit; a given one may not)."""
    from packtrain.memory import estimate as memory
    from packtrain.memory.budget import available_host_memory, format_node_pool, node_pool

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    have = cfg.ops.host_memory_per_node_gib
    if have is None:
        available = available_host_memory()
        if available is None:
            return
        have = available / memory.GiB
    est = memory.estimate_for_unit(cfg, unit_shape(cfg, plan, examples, kinds), world_size)
    pool = node_pool(est.total("host"), per_node, int(have * memory.GiB))
    if not pool["fits"]:
        raise ValueError(f"train.offload: {format_node_pool(pool)} (the largest pack's layer inputs on each "
                         "rank); lower packing.token_budget, run fewer ranks per node, or turn train.offload off "
                         "(ops.host_memory_per_node_gib sets the node's memory)")


def _exception_class(name: str) -> type:
    import builtins

    from packtrain.data import jsonl, planner

    for where in (jsonl, planner, builtins, torch.cuda):
        cls = getattr(where, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            return cls
    raise ValueError(f"train.skippable_errors: unknown exception class {name!r}")


@dataclass
class Counters:
    """The run's counters: what a checkpoint saves of the run's progress (state.json), and what a resume restores."""
    step: int = 0  # optimizer steps done
    nonfinite_skips: int = 0  # steps skipped without an update for a NaN/inf loss or gradient norm
    tokens_seen: int = 0  # positions of the packs trained so far (P once per pack)


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, log=print, overwrite: bool = False,
                 overrides: RunOverrides | None = None):
        self.cfg = cfg
        self.log = log
        self.overrides = overrides or RunOverrides()  # the --set overrides it runs with, recorded for a resume
        self.info: DistInfo = init_distributed(cfg.train.device, cfg.ops.collective_timeout)
        self.out = cfg.output_path
        # every rank runs the same config on the same data, or none starts: checked before anything is written
        check_same_config(cfg, self.info)
        # and what the config asks of the data (the plan, the steps, the budget), refused before anything is written
        self._plan(cfg)
        # One run per directory: the lock, and a previous run is only continued (--resume) or removed (--overwrite).
        self.lock = rundir.claim(self.out, resume, overwrite, self.info, log)
        # check-nodes (refuses mismatched ranks before step 0), hang watchdog, SIGUSR1 stacks, wandb; it goes
        # before the model build and resume, which already run collectives
        self.ops = RunOps(cfg, self.info, self.out, log=log)
        self.signals = StopSignals(announce=self.info.is_main)
        self.signals.install()  # from here SIGTERM/SIGINT only set a flag, acted on at a step boundary
        try:
            self.ops.start()
            self._setup(cfg, resume)
        except BaseException as e:
            stop = self._fail(e)
            if stop is e:
                raise
            raise stop from None

    # -- setup --------------------------------------------------------------------------------------------------
    def _plan(self, cfg: Config) -> None:
        """Everything the run's data and config decide before a model exists, on every rank: the examples, the plan
        (the same on every rank), the savings, the steps. Nothing is written: a refusal here leaves ``output_dir``
        untouched."""
        self.skippable = tuple(_exception_class(name) for name in cfg.train.skippable_errors)
        # the run's setup (packtrain/run/session.py): splits, checks, plan, the savings for the largest unit on this
        # device agreed by every rank; generate.every: a bad generate.metric fails here, before the model is built
        # rl.num_generations: the samples' rewards are generate.metric's too
        s = self.session = open_session(cfg, self.info, "train", with_eval=True,
                                        task=cfg.generate.every is not None or cfg.rl.num_generations is not None)
        self.train_examples, self.eval_examples = s.examples, s.eval_examples
        self.plan, self.eval_plan, self.savings = s.plan, s.eval_plan, s.choice
        self.fingerprint = plan_fingerprint(self.plan, self.train_examples)  # every token of the plan: once
        self.weight_digest = weights_fingerprint(self.plan, self.train_examples)
        check_same_plan(self.fingerprint, self.info)
        if s.kinds.objective.online:  # each step's groups, sampled from the plan's requests (packtrain.run.rollouts)
            rollouts.check_room(cfg, s.kinds, self.plan, self.train_examples)
        self.run_cfg = s.run_cfg
        if self.run_cfg.train.offload:
            check_node_pool(self.run_cfg, self.plan, self.train_examples, self.info.world_size, s.kinds)
        self.idle_warning = balance.idle_ranks(cfg, self.info.world_size)  # said before the header and in it
        if self.idle_warning is not None and self.info.is_main:
            self._log(fit(self.idle_warning))
        self.steps = StepPlan.for_run(cfg, self.plan, self.train_examples, self.info.world_size)
        self.steps_per_epoch = self.steps.steps_per_epoch
        self.total_steps = cfg.train.epochs * self.steps_per_epoch
        if cfg.train.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.train.max_steps)

    def _setup(self, cfg: Config, resume: bool) -> None:
        # a resume is accepted or refused before the model is built (and base/ written again)
        found = self._resume_point() if resume else None
        self.out.mkdir(parents=True, exist_ok=True)
        base_dir = self.out / "base" if cfg.model.config is not None else None
        s = self.session
        s.build_model(save_base_to=base_dir if self.info.is_main else None)
        self.model, self.lm, self.backend, self.kinds = s.model, s.lm, s.backend, s.kinds
        self.task = None  # generate.every: the held-out examples generated and scored (packtrain.run.task)
        if cfg.generate.every is not None:
            self.task = s.task()
        self.online = None  # rl.num_generations: each step's groups sampled, scored and written
        if self.kinds.objective.online:
            self.online = rollouts.Online(cfg, self.plan, self.train_examples, self.kinds, self.info, self.out,
                                          s.scorer, s.task_tokenizer)
            self.online.check(self.model)
        self.params = [p for p in self.lm.parameters() if p.requires_grad]
        if self.info.is_main:  # what the run is, before its first long pass (the dpo reference)
            self._log(header(self))
        if self.kinds.objective.precomputes:
            table = self._reference_table(cfg)
            self.kinds = dataclasses.replace(self.kinds, objective=self.kinds.objective.with_table(table))
        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        # Each rank draws its own dropout masks; train.seed fixes them (and a checkpoint stores every rank's state).
        torch.manual_seed(cfg.train.seed + 1_000_003 * self.info.rank)
        self.step = Step(self.lm, self.kinds, self.plan, self.train_examples, self.info, self.params, self.optimizer,
                         self.scheduler, cfg.optim.max_grad_norm, cfg.train.max_positions, self.skippable,
                         signals=self.signals)
        self.counters = Counters()
        self.stop_agreed = False  # a rank was signalled (SIGTERM/SIGINT): every rank stops after this step
        self.ops.progress("model setup")
        if found is not None:
            self._resume(*found)
        self.metrics = MetricsLog(self.out / "metrics.jsonl", enabled=self.info.is_main, resume=resume)
        if resume:
            # from step 0 the step-0 evaluation runs again: keep none of the old lines
            step = self.counters.step
            self.metrics.truncate_after(step if step > 0 else -1, warn=self.log)
        self.cadence = self._cadence(cfg)
        if found is not None:
            latest, state = found
            self.cadence.resume(state.get("owed", []), latest)
        if self.info.is_main:
            (self.out / "config.yaml").write_text(self._config_yaml(cfg))
            overrides.write(self.out, self.overrides)
            # the tokenizer and chat template the run trains with, which its exports carry
            save_run_tokenizer(cfg, self.out, getattr(self.model.config, "vision_config", None) is not None)

    def _config_yaml(self, cfg: Config) -> str:
        """OUTPUT/config.yaml: the run's config as it ran (its --set overrides applied, every path absolute), so that
        ``packtrain train OUTPUT/config.yaml --resume`` (or ``eval``, ``export``) runs it again from anywhere."""
        return ("# the config this run trains with: its --set overrides applied, every path absolute\n"
                + yaml.safe_dump(cfg.to_dict(resolved=True), sort_keys=False) + self._chosen_note())

    def _chosen(self) -> dict:
        """The memory savings this run trains with (the config's ``auto`` resolved), {} when none were chosen."""
        return self.savings.values() if self.savings is not None else {}

    def _chosen_note(self) -> str:
        """config.yaml keeps the user's values (``auto`` stays ``auto``); what the run chose is written beside them,
        as comments, and in every checkpoint's state.json (``"savings"``)."""
        lines = [f"#   train.{key}: {value}" for key, value in self._chosen().items()]
        return "\n".join(["", "# the savings this run chose (packtrain/memory/savings.py), on this device:", *lines, ""]
                         ) if lines else ""

    def _reference_table(self, cfg: Config) -> dict:
        """dpo, and grpo with rl.beta > 0, precompute: the reference log-probabilities of the training examples (a
        dpo answer's sum, each of a grpo completion's tokens), read from OUTPUT/reference.json
        (rank 0 reads it and every rank gets it, or its refusal) or computed by every rank and written by rank 0
        (packtrain.run.reference)."""
        name = self.kinds.objective.name
        expected = reference.digests(cfg, self.train_examples)
        planned = [self.train_examples[e].id for pack in self.plan.packs for e in pack.examples]
        found: list = [None]
        if self.info.is_main:
            try:
                found[0] = ("table", reference.read(self.out, expected, planned))
            except ValueError as e:
                found[0] = ("refused", str(e))
        if self.info.enabled:
            torch.distributed.broadcast_object_list(found, src=0)
        verdict, value = found[0]
        if verdict == "refused":
            raise ValueError(value)
        have = value or {}
        if value is not None and all(i in have for i in planned):
            self.log(f"{name} reference: {len(value):,} log-probabilities read from {self.out / reference.FILE}")
            return value
        if have and self.info.is_main:
            self.log(f"{name} reference: {len(have):,} log-probabilities read from {self.out / reference.FILE} (a "
                     "pass stopped part way); computing the rest")
        t0 = time.perf_counter()
        bar = tqdm(total=None, desc="reference", unit="unit", leave=False,
                   disable=not (self.info.is_main and cfg.logging.progress and sys.stderr.isatty()))
        # a signal is acted on between the pass's batches: what is done is kept, a resume computes the rest
        table, complete = reference.compute_in_batches(
            self.lm, self.plan, self.train_examples, self.kinds, self.info, have,
            lambda: bool(agree([int(self.signals.requested)], self.info)[0]),
            Beating(bar, lambda: self.ops.progress(f"a {name} reference unit")))
        bar.close()
        path = self.out / reference.FILE
        if self.info.is_main:
            reference.write(self.out, expected, table, partial=not complete)
        if not complete:
            raise Preempted(f"stopped by {self.signals.name()} during the {name} reference pass: {len(table):,} of "
                            f"{len(planned):,} log-probabilities kept in {path}; continue with `packtrain train CONFIG "
                            "--resume`", quiet=not self.info.is_main)
        if self.info.is_main:
            self.log(f"{name} reference: {len(table) - len(have):,} log-probabilities of the base model (adapter "
                     f"disabled) in {time.perf_counter() - t0:.1f} s, written to {path}")
        return table

    def _cadence(self, cfg: Config) -> Cadence:
        """What runs between steps (packtrain.run.cadence): the eval loss (data.eval), the task (generate.every),
        checkpoints."""
        records = Records(self.metrics, self.ops, self.info, cfg.logging.progress)
        evaluations = []
        if self.eval_plan is not None:  # online grpo's held-out requests: their targets' cross-entropy, as sft's
            kinds = dataclasses.replace(self.kinds, objective=Sft()) if self.online is not None else self.kinds
            evaluations.append(Evaluation(self.lm, self.eval_plan, self.eval_examples, kinds, records,
                                          self.steps_per_epoch, cfg.train.eval_every))
        if self.task is not None:
            evaluations.append(Generation(self.lm, self.task, self.kinds, records, self.out, cfg.generate.every))
        parts = (self.lm, self.model, self.optimizer, self.scheduler, self.params)
        return Cadence(evaluations, Checkpoints(self.out, cfg.train.save_every, self.total_steps,
                                                cfg.train.keep_checkpoints, parts, self._state, self.info, self.ops,
                                                self.log))

    # -- the run ------------------------------------------------------------------------------------------------
    def train(self) -> dict:
        try:
            summary = self._train()
        except Preempted:
            self._close(keep_signal_handlers=True)  # a second signal while exiting must not kill the exit code
            raise
        except BaseException as e:
            stop = self._fail(e)
            if stop is e:
                raise
            raise stop from None
        self._close()
        return summary

    def _fail(self, e: BaseException) -> BaseException:
        """Close after ``e``; what to raise: for a collective whose peer died, one retryable line
        (:class:`PeerLost`) in place of gloo's traceback."""
        lost = lost_peer(e)  # first: it waits (bounded) for a peer of this host to finish exiting
        self._close()
        if lost is None:
            return e
        return PeerLost(f"{lost}; the checkpoints so far are kept: restart every machine with `packtrain train "
                        f"CONFIG --resume` (exit {PeerLost.exit_code})")

    def _close(self, keep_signal_handlers: bool = False) -> None:
        self.ops.close()
        if not keep_signal_handlers:
            self.signals.restore()
        if self.lock is not None:
            self.lock.release()

    def _train(self) -> dict:
        c, cadence = self.counters, self.cadence
        # a signal during setup stops here, before any work (the step's own agreement takes the flag from here on)
        self.stop_agreed = bool(agree([int(self.signals.requested)], self.info)[0])
        if self.stop_agreed:
            self._stop_preempted()
        cadence.start(c.step)
        checked = False  # whether the loss reaches the adapters: checked on this process's first step that can show it
        progress = Progress(self.info.is_main, self.cfg.logging.progress, self.cfg.logging.every, self.total_steps,
                            c.step, log=self.log)
        while c.step < self.total_steps:
            epoch, index = divmod(c.step, self.steps_per_epoch)
            record, verified = self._train_step(epoch, self.steps.pack_ids(epoch, index), not checked)
            checked = checked or verified
            self._log_step(record, progress)
            if self.stop_agreed and c.step < self.total_steps:
                progress.close()
                self._stop_preempted()
            cadence.after(c.step)
        progress.close()
        cadence.end(c.step)
        self._save_final()
        return self._summary()

    def _summary(self) -> dict:
        def figures(e):  # (at step 0, last, its step)
            return (None, None, None) if e is None else (e.first, e.last, e.last_step)

        (eval_before, eval_after, eval_step), (task_before, task_after, task_step) = (
            figures(self.cadence.get("eval")), figures(self.cadence.get("generate")))
        summary = {"steps": self.counters.step, "eval_before": eval_before, "eval_after": eval_after,
                   "eval_after_step": eval_step, "task_before": task_before, "task_after": task_after,
                   "task_after_step": task_step, "adapter": str(self.out / "adapter"), "plot": str(self.out / "loss.png")}
        evaluation = self.cadence.get("eval")
        if evaluation is not None and self.kinds.objective.paired:  # dpo: the reward accuracy on data.eval's pairs
            summary["reward_accuracy_before"], summary["reward_accuracy_after"] = (
                None if record is None else record["reward_accuracy"]
                for record in (evaluation.first_record, evaluation.record))
        if self.info.is_main:
            self._log(footer(summary, self.out / "metrics.jsonl"))
        return summary

    def _log(self, lines: list[str]) -> None:
        for line in lines:
            self.log(line)

    def _log_step(self, record: dict, progress: Progress) -> None:
        self.metrics.write(record)
        self.ops.step_done(record)
        self.counters.tokens_seen += record["positions"]
        progress.step(record, self.counters.tokens_seen)

    # -- one step -----------------------------------------------------------------------------------------------
    def _train_step(self, epoch: int, pack_ids: list[int], check_gradients: bool) -> tuple[dict, bool]:
        """One optimizer step on the packs ``pack_ids`` (the schedule's, :class:`~packtrain.run.balance.StepPlan`):
        the step's verdicts acted on; its record, and whether it checked that the loss reaches the adapters."""
        c = self.counters
        step, sampled = self.step, {}
        if self.online is not None:  # the step's groups: sampled now, written, planned as the run's packs
            records, sampled = self.online.sample(self.lm, self.model, pack_ids, c.step)
            path = self.online.write(records, c.step + 1)
            groups = rollouts.group_examples(records, path)
            plan = self.kinds.plan(self.cfg, groups)
            step, pack_ids = dataclasses.replace(self.step, plan=plan, examples=groups), list(range(len(plan.packs)))
        r = step.run(pack_ids, c.step, check_gradients)
        if r.nonfinite:  # no update was made: skipped, or the run stops here
            self._skip_nonfinite(r.loss, r.grad_norm)
            r.loss = r.grad_norm = None
        self.stop_agreed = self.stop_agreed or r.stop
        c.step += 1
        return {"step": c.step, "epoch": epoch, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                "examples": r.examples, "packs": len(pack_ids), "positions": r.positions, "skipped": r.skipped,
                "skipped_examples": r.skipped_examples, "nonfinite": r.nonfinite, "nonfinite_skips": c.nonfinite_skips,
                "seconds": r.seconds, "peak_memory_bytes": peak_memory_bytes(self.info.device), **r.figures,
                **sampled}, \
            r.gradients_checked

    def _skip_nonfinite(self, loss: float | None, grad_norm: float) -> None:
        """No update for a NaN/inf step: skipped while train.max_nonfinite_skips allows, else the run stops."""
        c = self.counters
        c.nonfinite_skips += 1
        step, limit = c.step + 1, self.cfg.train.max_nonfinite_skips
        if c.nonfinite_skips > limit:
            last = self.cadence.checkpoints.last
            last = str(last) if last is not None else None
            raise NonFiniteError(finite.stop_message(step, loss, grad_norm, self.cfg, last, c.nonfinite_skips - 1),
                                 quiet=not self.info.is_main)
        if self.info.is_main:
            tqdm.write(f"step {step}: {finite.describe(loss, grad_norm)}: skipped without an update "
                       f"({c.nonfinite_skips} of train.max_nonfinite_skips={limit})")

    def _stop_preempted(self) -> None:
        """Every rank agreed to stop after this step: a checkpoint with every rank, then exit 75."""
        step = self.counters.step
        stopped = f"stopped by {self.signals.name()} after step {step} of {self.total_steps}"
        if step == 0:
            raise Preempted(f"{stopped}: nothing trained yet, nothing to save; run again", quiet=not self.info.is_main)
        written = self.cadence.checkpoints.stopping(step)
        raise Preempted(f"{stopped}: checkpoint {written} written; continue with `packtrain train CONFIG --resume` "
                        f"(its --set overrides are recorded in {self.out / overrides.FILE} and kept)",
                        quiet=not self.info.is_main)

    # -- saving and resuming ------------------------------------------------------------------------------------
    def _state(self) -> dict:
        """What state.json holds besides the step (which :func:`packtrain.rundir.checkpoint.save_checkpoint`
        writes): the counters, and what a resume checks it is the same run."""
        c = self.counters
        return {"epoch": c.step // self.steps_per_epoch, "plan": self.fingerprint, "weights": self.weight_digest,
                "world_size": self.info.world_size, "packs_per_step": self.steps.per_step, "mode": self.kinds.mode,
                "total_steps": self.total_steps,
                "nonfinite_skips": c.nonfinite_skips, "tokens_seen": c.tokens_seen, "owed": self.cadence.owed(c.step),
                "config": self.cfg.to_dict(resolved=True),
                "savings": self._chosen()}

    def _save_final(self) -> None:
        finite.check_parameters(self.params, self.info, self.counters.step)
        trainable = ckpt.trainable_state(self.lm, self.info)
        if self.info.is_main:
            ckpt.save_adapter(self.model, self.out / "adapter", state_dict=trainable, step=self.counters.step)
            plot_losses(self.out / "metrics.jsonl", self.out / "loss.png")
        barrier(self.info)

    def _resume_point(self) -> tuple[Path, dict] | None:
        """``--resume``: the checkpoint to continue from and its state, once the resume is accepted (the same run, not
        past this config's steps); None to start from step 0, which a run that has not finished may do."""
        log = self.log if self.info.is_main else (lambda *a: None)
        found = resuming.choose_checkpoint(self.out, self.info, log)
        if found is None:
            resuming.check_steps(self.out, 0, None, self.total_steps, self.info)  # refuses a finished run
            log(f"resume: no checkpoint in {self.out / 'checkpoints'}; starting from step 0")
            return None
        latest, state, damaged = found
        resuming.check_same_run(state, self.cfg.to_dict(resolved=True), self.fingerprint, self.total_steps, latest, log,
                                self.weight_digest, self.steps.per_step)
        resuming.check_steps(self.out, state["step"], latest, self.total_steps, self.info)
        resuming.set_aside(damaged, latest, self.info, log)  # accepted: only now does anything move
        return latest, state

    def _resume(self, latest: Path, state: dict) -> None:
        log = self.log if self.info.is_main else (lambda *a: None)
        ckpt.load_checkpoint(latest, self.lm, self.optimizer, self.scheduler, self.info)
        self.counters = Counters(step=state["step"], nonfinite_skips=state["nonfinite_skips"],
                                 tokens_seen=state.get("tokens_seen", 0))
        self.ops.progress(f"resumed from {latest.name}")
        log(f"resume: continuing from {latest} (step {self.counters.step}, written with world size "
            f"{state['world_size']}, now {self.info.world_size})")
