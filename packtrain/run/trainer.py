"""The training run, top to bottom: setup -> (step, log, eval, save)* -> final adapter.

    examples -> planner -> packs -> per-rank units -> layout -> patched model -> loss -> backward -> AdamW/SGD

An optimizer step takes ``train.packs_per_step`` packs (global across ranks). Each unit's ``loss_sum`` (sum of
per-example mean target cross-entropies) is scaled by 1 / (examples in the whole step), so the update is the
mean of per-example losses whatever the split into packs, micro-steps, modes or ranks.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from packtrain.config import Config
from packtrain.data.examples import load_split, processor_dir
from packtrain.data.images import ImageLoader, load_image_processor
from packtrain.data.planner import Plan, plan_packs, plan_stats
from packtrain.distributed import DistInfo, all_reduce_max_tensor, all_reduce_sum, barrier, init_distributed
from packtrain.exits import NonFiniteError, Preempted
from packtrain.models.build import build_base_model
from packtrain.models.wrap import prepare_from_config
from packtrain.ops.runtime import RunOps
from packtrain.packed.families import check_model
from packtrain.packed.families import describe as describe_model
from packtrain.packed.groups import Groups, train_groups
from packtrain.packed.patch import vision_spec
from packtrain.packed.walk import train_walk
from packtrain.run import finite
from packtrain.run.evaluate import evaluate, mean_loss
from packtrain.run.metrics import MetricsLog, peak_memory_bytes, plot_losses
from packtrain.run.optim import build_optimizer, build_scheduler
from packtrain.run.signals import StopSignals
from packtrain.run.steps import rank_units, step_examples, step_packs, steps_per_epoch, unit_groups, unit_layout
from packtrain.rundir import checkpoint as ckpt
from packtrain.rundir import directory as rundir
from packtrain.rundir import resume as resuming


class ZeroGradientError(RuntimeError):
    pass


OK, SKIP, FATAL = 0, 1, 2  # per-unit codes, agreed across ranks with an all-reduce MAX


def _exception_class(name: str) -> type:
    import builtins

    from packtrain.data import examples as data
    from packtrain.data import planner

    for where in (data, planner, builtins, torch.cuda):
        cls = getattr(where, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            return cls
    raise ValueError(f"train.skippable_errors: unknown exception class {name!r}")


CUT_OFF = ("the adapters are cut off from the loss: frozen embeddings without enable_input_require_grads, a "
           "detached layer, or lora.target_modules the loss does not depend on")


def plan_for(cfg: Config, examples) -> Plan:
    p = cfg.packing
    return plan_packs(examples, p.token_budget, p.max_continuations, p.on_overflow, cfg.train.seed,
                      walk=cfg.walk_spec(), frozen=p.context_grad == "frozen")


def image_loader(cfg: Config, model, examples) -> ImageLoader | None:
    """The loader for examples' images (None when no example has one); refuses a text-only model."""
    if not any(ex.images for ex in examples):
        return None
    spec = vision_spec(model)
    if spec is None:
        raise ValueError("the data has images but the model is text-only: use a vision-language model "
                         "(model_type qwen3_5 or qwen3_5_moe)")
    return ImageLoader(load_image_processor(processor_dir(cfg)), spec)


def plan_fingerprint(plan: Plan, examples) -> str:
    """The packs and the tokens in them (each P, item and target; image paths and grids): edited data differs."""
    import hashlib

    h = hashlib.sha256()
    for pack in plan.packs:
        h.update(repr((pack.prompt, pack.examples, plan.prompts[pack.prompt])).encode())
        for e in pack.examples:
            ex = examples[e]
            h.update(repr((ex.item_ids, ex.target_ids, [(r.path, r.grid_thw) for r in ex.images])).encode())
    return h.hexdigest()[:16]


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, log=print, overwrite: bool = False):
        self.cfg = cfg
        self.log = log
        self.dist: DistInfo = init_distributed(cfg.train.device, cfg.ops.collective_timeout)
        self.out = Path(cfg.output_dir)
        # One run per directory: the lock, and a previous run is only continued (--resume) or removed (--overwrite).
        self.lock = rundir.claim(self.out, resume, overwrite, self.dist, log)
        # check-nodes (refuses mismatched ranks before step 0), hang watchdog, SIGUSR1 stacks, wandb; it goes
        # before the model build and resume, which already run collectives
        self.ops = RunOps(cfg, self.dist, self.out, log=log)
        self.signals = StopSignals()
        self.signals.install()  # from here SIGTERM/SIGINT only set a flag, acted on at a step boundary
        try:
            self.ops.start()
            self._setup(cfg, resume)
        except BaseException:
            self._close()
            raise

    def _setup(self, cfg: Config, resume: bool) -> None:
        check_model(cfg)  # an unsupported model family or layer type is refused before any data is read
        self.mode = cfg.packing.mode
        self.walk = cfg.walk_spec()
        self.groups = cfg.packing.continuation_groups
        self.train_examples = load_split(cfg, "train")
        if self.train_examples is None:
            raise ValueError("data.train: not set")
        self.eval_examples = load_split(cfg, "eval")
        pictured = next((ex for ex in self.train_examples if getattr(ex, "images", ())), None)
        if self.groups > 1 and pictured is not None:
            raise ValueError(f"{pictured.source}: has images, and packing.continuation_groups > 1 takes text-only "
                             f"data (set packing.continuation_groups: 1)")
        self.plan = plan_for(cfg, self.train_examples)
        self.eval_plan = plan_for(cfg, self.eval_examples) if self.eval_examples else None
        self.steps_per_epoch = steps_per_epoch(self.plan, cfg.train.packs_per_step)
        self.total_steps = cfg.train.epochs * self.steps_per_epoch
        if cfg.train.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.train.max_steps)

        self.out.mkdir(parents=True, exist_ok=True)
        base_dir = self.out / "base" if cfg.model.config is not None else None
        model = build_base_model(cfg, save_to=base_dir if self.dist.is_main else None, meta=True)
        self.model, self.lm, self.backend = prepare_from_config(model, cfg, self.dist.device,
                                                                shard=self.dist.enabled)
        self.images = image_loader(cfg, self.model, self.train_examples + (self.eval_examples or []))
        t = cfg.train
        self.params = [p for p in self.lm.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        # Each rank draws its own dropout masks; the seed fixes them (and a checkpoint stores every rank's state).
        torch.manual_seed(t.seed + 1_000_003 * self.dist.rank)
        self.skippable = tuple(_exception_class(name) for name in t.skippable_errors)
        self.step = 0
        self.skipped_total = 0
        self.nonfinite_skips = 0
        self.last_checkpoint: Path | None = None
        self.stop_agreed = False  # a rank was signalled (SIGTERM/SIGINT): every rank stops after this step
        self.ops.progress("model setup")
        self.last_eval_step: int | None = None  # the footer names the step its eval loss is from
        if resume:
            self._resume()
        self.metrics = MetricsLog(self.out / "metrics.jsonl", enabled=self.dist.is_main, resume=resume)
        if resume:
            # from step 0 the step-0 evaluation runs again: keep none of the old lines
            self.metrics.truncate_after(self.step if self.step > 0 else -1, warn=self.log)
        if self.dist.is_main:
            (self.out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    # -- the run ---------------------------------------------------------------------------------------------
    def train(self) -> dict:
        try:
            summary = self._train()
        except Preempted:
            self._close(keep_signal_handlers=True)  # a second signal while exiting must not kill the exit code
            raise
        except BaseException:
            self._close()
            raise
        self._close()
        return summary

    def _close(self, keep_signal_handlers: bool = False) -> None:
        self.ops.close()
        if not keep_signal_handlers:
            self.signals.restore()
        if self.lock is not None:
            self.lock.release()

    def _train(self) -> dict:
        cfg, info = self.cfg, self.dist
        self._print_header()
        self._agree_at_boundary(nonfinite=False)  # a signal during setup stops here, before any work
        if self.stop_agreed:
            self._stop_preempted()
        first_eval = last_eval = None
        if self.eval_plan is not None and self.step == 0:
            first_eval = last_eval = self._eval()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (info.is_main and cfg.logging.progress))
        checked_gradients = False
        while self.step < self.total_steps:
            record = self._train_step(check_gradients=not checked_gradients)
            checked_gradients = True
            self.metrics.write(record)
            self.ops.step_done(record)
            loss = "skipped" if record["loss"] is None else f"{record['loss']:.4f}"
            bar.set_postfix(loss=loss, lr=f"{record['lr']:.2e}",
                            pos_s=f"{record['positions'] / max(record['seconds'], 1e-9):.0f}")
            bar.update(1)
            if self.stop_agreed and self.step < self.total_steps:
                bar.close()
                self._stop_preempted()
            end_of_epoch = self.step % self.steps_per_epoch == 0
            every = cfg.train.eval_every
            if self.eval_plan is not None and (end_of_epoch or (every and self.step % every == 0)):
                last_eval = self._eval()
            if self.step % cfg.train.save_every == 0 and self.step < self.total_steps:
                self._save_checkpoint()
        bar.close()
        if self.eval_plan is not None and self.last_eval_step != self.step:  # max_steps mid-epoch, or eval_every
            last_eval = self._eval()
        self._save_final()
        summary = {"steps": self.step, "eval_before": first_eval, "eval_after": last_eval,
                   "eval_after_step": self.last_eval_step,
                   "adapter": str(self.out / "adapter"), "plot": str(self.out / "loss.png")}
        self._print_footer(summary)
        return summary

    def _prepare_units(self, units) -> tuple[list, list[bool], int]:
        """Build every unit's layout and agree with all ranks, before any collective of the step, which units
        to skip. Returns (layouts, skip flags per unit index, examples skipped across all ranks)."""
        info, cap = self.dist, self.cfg.train.max_positions
        codes, layouts, errors = [], [], []
        for unit in units:
            code, layout = OK, None
            try:
                if self.groups > 1 and unit.walk is None:
                    layout = unit_groups(unit, self.plan, self.train_examples, self.groups, self.images)
                else:
                    layout = unit_layout(unit, self.plan, self.train_examples, self.mode, self.images)
                if cap is not None and unit.walk is None and layout.length > cap:
                    code = SKIP
            except self.skippable:
                code = SKIP
            except Exception as e:  # noqa: BLE001 - reported below, after every rank knows
                code, errors = FATAL, errors + [e]
            codes.append(code)
            layouts.append(layout)
        agreed = all_reduce_max_tensor(torch.tensor(codes or [OK], dtype=torch.int64, device=info.device), info)
        if int(agreed.max()) == FATAL:
            if errors:
                raise errors[0]
            raise RuntimeError("another rank failed while preparing this step (its error is in its log)")
        skip = [int(c) == SKIP for c in agreed.tolist()[:len(units)]]
        mine = sum(len(u.examples) for u, s in zip(units, skip) if s and not u.dummy)
        skipped = int(all_reduce_sum(torch.tensor([mine], dtype=torch.int64, device=info.device), info)[0])
        return layouts, skip, skipped

    def _train_step(self, check_gradients: bool) -> dict:
        cfg, info = self.cfg, self.dist
        epoch, index = divmod(self.step, self.steps_per_epoch)
        t0 = time.perf_counter()
        pack_ids = step_packs(self.plan, epoch, index, cfg.train.packs_per_step, cfg.train.seed)
        units = rank_units(self.plan, pack_ids, self.mode, info.rank, info.world_size)
        layouts, skip, skipped_examples = self._prepare_units(units)
        n_examples = step_examples(self.plan, pack_ids) - skipped_examples
        totals = torch.zeros(2, dtype=torch.float64, device=info.device)  # [sum of per-example losses, positions]
        for unit, layout, skipped in zip(units, layouts, skip):
            if skipped or n_examples == 0:
                continue
            # FSDP averages gradients over ranks; the world factor turns that average into the global sum.
            scale = 0.0 if unit.dummy else info.world_size / n_examples
            if finite.injected_nan(info.rank, self.step + 1):
                scale = math.nan
            if unit.walk is not None:  # an over-budget example, chunk by chunk; backward inside (packtrain/packed/walk.py)
                loss = train_walk(self.lm, layout.to(info.device), self.walk, scale, unit.walk, unit.dummy).loss
            elif isinstance(layout, Groups):  # the pack's continuations in groups; backward inside (groups.py)
                loss = train_groups(self.lm, layout.to(info.device), scale)
            else:
                out = self.lm(layout.to(info.device))
                if not out.loss_sum.requires_grad:
                    raise ZeroGradientError(CUT_OFF + " (the loss does not require grad at all)")
                (out.loss_sum * scale).backward()
                loss = out.per_example.sum().item()
            if not unit.dummy:
                totals += torch.tensor([loss, layout.length], dtype=torch.float64, device=info.device)
        all_reduce_sum(totals, info)
        grad_norm, lr = 0.0, self.scheduler.get_last_lr()[0]
        loss = float(totals[0]) / n_examples if n_examples else None
        if n_examples > 0:
            max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else math.inf
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        nonfinite = self._agree_at_boundary(n_examples > 0 and not finite.is_finite(loss, grad_norm))
        if nonfinite:
            self._skip_nonfinite(loss, grad_norm)
            loss = grad_norm = None
        elif n_examples > 0:
            if check_gradients and grad_norm == 0.0:
                raise ZeroGradientError(CUT_OFF + " (every trainable gradient is zero after the first step)")
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        n_skipped = sum(skip)
        self.skipped_total += n_skipped
        return {"step": self.step, "epoch": epoch, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "examples": n_examples, "packs": len(pack_ids), "positions": int(totals[1]), "skipped": n_skipped,
                "skipped_examples": skipped_examples, "nonfinite": nonfinite, "nonfinite_skips": self.nonfinite_skips,
                "seconds": time.perf_counter() - t0, "peak_memory_bytes": peak_memory_bytes(info.device)}

    def _agree_at_boundary(self, nonfinite: bool) -> bool:
        """The step's one extra all-reduce: every rank learns whether the step is non-finite on any rank and whether
        any rank was signalled, before the update. Returns the non-finite verdict; sets ``stop_agreed``."""
        flags = torch.tensor([int(nonfinite), int(self.signals.requested)], dtype=torch.int64, device=self.dist.device)
        agreed = all_reduce_max_tensor(flags, self.dist).tolist()
        self.stop_agreed = self.stop_agreed or bool(agreed[1])
        return bool(agreed[0])

    def _skip_nonfinite(self, loss: float | None, grad_norm: float) -> None:
        """No update for a NaN/inf step: skipped while train.max_nonfinite_skips allows, else the run stops."""
        self.nonfinite_skips += 1
        step, is_main = self.step + 1, self.dist.is_main
        if self.nonfinite_skips > self.cfg.train.max_nonfinite_skips:
            last = str(self.last_checkpoint) if self.last_checkpoint is not None else None
            raise NonFiniteError(finite.stop_message(step, loss, grad_norm, self.cfg, last, self.nonfinite_skips - 1),
                                 quiet=not is_main)
        if is_main:
            tqdm.write(f"step {step}: {finite.describe(loss, grad_norm)}: skipped without an update "
                       f"({self.nonfinite_skips} of train.max_nonfinite_skips={self.cfg.train.max_nonfinite_skips})")

    def _stop_preempted(self) -> None:
        """Every rank agreed to stop after this step: a checkpoint with every rank, then exit 75."""
        stopped = f"stopped by {self.signals.name()} after step {self.step} of {self.total_steps}"
        if self.step == 0:
            raise Preempted(f"{stopped}: nothing trained yet, nothing to save; run again", quiet=not self.dist.is_main)
        if self.last_checkpoint is None or self.last_checkpoint.name != f"step-{self.step}":
            self._save_checkpoint()
        raise Preempted(f"{stopped}: checkpoint {self.last_checkpoint} written; continue with `packtrain train "
                        "CONFIG --resume`", quiet=not self.dist.is_main)

    def _eval(self) -> float:
        info = self.dist
        bar = tqdm(total=None, desc="eval", unit="unit", leave=False,  # a terminal only: it would litter logs
                   disable=not (info.is_main and self.cfg.logging.progress and sys.stderr.isatty()))
        rows = evaluate(self.lm, self.eval_plan, self.eval_examples, self.mode, info, images=self.images,
                        progress=_Beating(bar, lambda: self.ops.progress(f"eval unit at step {self.step}")),
                        walk=self.walk)
        bar.close()
        loss = mean_loss(rows)
        if not finite.is_finite(loss):  # the same on every rank: the rows are gathered everywhere
            raise NonFiniteError(f"eval at step {self.step}: loss {loss!r}; the model has diverged (see the "
                                 "train loss in metrics.jsonl); nothing was saved", quiet=not info.is_main)
        self.last_eval_step = self.step
        record = {"split": "eval", "step": self.step, "loss": loss, "examples": len(rows)}
        self.metrics.write(record)
        self.ops.eval_done(record)
        if info.is_main:
            tqdm.write(f"eval  step {self.step}: loss {loss:.4f} over {len(rows)} examples")
        return loss

    # -- saving and resuming --------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {"epoch": self.step // self.steps_per_epoch, "plan": plan_fingerprint(self.plan, self.train_examples),
                "world_size": self.dist.world_size, "mode": self.mode, "total_steps": self.total_steps,
                "nonfinite_skips": self.nonfinite_skips, "config": self.cfg.to_dict()}

    def _save_checkpoint(self) -> None:
        finite.check_parameters(self.params, self.dist, self.step)
        self.last_checkpoint = ckpt.save_checkpoint(self.out, self.step, self.lm, self.model, self.optimizer,
                                                    self.scheduler, self._state(), self.dist)
        if self.dist.is_main:
            rundir.prune_checkpoints(self.out, self.cfg.train.keep_checkpoints, self.log)
        self.ops.progress(f"checkpoint at step {self.step}")
        # Fault injection for resume tests: die like a preempted job (SIGKILL: no cleanup, no final save).
        if os.environ.get("PACKTRAIN_KILL_AFTER_CHECKPOINT") == str(self.step):
            os.kill(os.getpid(), signal.SIGKILL)

    def _save_final(self) -> None:
        finite.check_parameters(self.params, self.dist, self.step)
        trainable = ckpt.trainable_state(self.lm, self.dist)
        if self.dist.is_main:
            ckpt.save_adapter(self.model, self.out / "adapter", state_dict=trainable)
            plot_losses(self.out / "metrics.jsonl", self.out / "loss.png")
        barrier(self.dist)

    def _resume(self) -> None:
        log = self.log if self.dist.is_main else (lambda *a: None)
        found = resuming.choose_checkpoint(self.out, self.dist, log)
        if found is None:
            log(f"resume: no checkpoint in {self.out / 'checkpoints'}; starting from step 0")
            return
        latest, state = found
        resuming.check_same_run(state, self.cfg.to_dict(), plan_fingerprint(self.plan, self.train_examples),
                                self.total_steps, latest, log)
        ckpt.load_checkpoint(latest, self.lm, self.optimizer, self.scheduler, self.dist)
        self.step, self.nonfinite_skips, self.last_checkpoint = state["step"], state["nonfinite_skips"], latest
        self.ops.progress(f"resumed from {latest.name}")
        if self.dist.is_main:
            self.log(f"resume: continuing from {latest} (step {self.step}, written with world size "
                     f"{state['world_size']}, now {self.dist.world_size})")

    # -- what the user sees ---------------------------------------------------------------------------------
    def _print_header(self) -> None:
        if not self.dist.is_main:
            return
        s = plan_stats(self.plan, self.train_examples)
        trainable = sum(p.numel() for p in self.params)
        self.log(f"packtrain train: {s['examples']} examples, {s['prompts']} prompts -> {s['packs']} packs "
                 f"(positions {s['positions_standalone']:,} standalone vs {s['positions_packed']:,} packed, "
                 f"{s['position_ratio']:.1f}x)")
        self.log(f"  mode {self.mode}, kernels: {self.backend.describe()}, device {self.dist.device}, "
                 f"world size {self.dist.world_size}, dtype {self.cfg.model.dtype}")
        self.log(f"  {describe_model(self.model)}")
        self.log(f"  context_grad {self.lm.context.describe()}")
        if self.walk is not None:
            self.log(f"  on_overflow {self.walk.describe()}: {s['walked']} examples over the budget in "
                     f"{s['walk_chunks']} chunks")
        if self.groups > 1:
            self.log(f"  continuation_groups {self.groups}: each pack's continuations in {self.groups} groups against "
                     "one P graph")
        if self.dist.enabled:
            local = sum(getattr(p, "_local_tensor", p).numel() for p in self.lm.parameters())
            total = sum(p.numel() for p in self.lm.parameters())
            self.log(f"  FSDP2 over {self.dist.world_size} ranks: rank 0 holds {local:,} of {total:,} parameter "
                     "elements")
        report = getattr(self.lm, "load_report", None)
        if report is not None:
            self.log(f"  weights: {report.describe()}")
        self.log(f"  {self.total_steps} steps ({self.steps_per_epoch} per epoch, {self.cfg.train.packs_per_step} "
                 f"packs per step), {trainable:,} trainable parameters, output {self.out}")

    def _print_footer(self, summary: dict) -> None:
        if not self.dist.is_main:
            return
        if summary["eval_before"] is not None:
            self.log(f"eval loss: {summary['eval_before']:.4f} at step 0 -> {summary['eval_after']:.4f} "
                     f"at step {summary['eval_after_step']}")
        self.log(f"adapter: {summary['adapter']}")
        self.log(f"loss plot: {summary['plot']}")
        self.log(f"metrics: {self.out / 'metrics.jsonl'}")


class _Beating:
    """A progress bar that also tells the hang watchdog an evaluation unit finished (a long eval is progress)."""

    def __init__(self, bar, beat):
        self.bar, self.beat = bar, beat

    def update(self, n: int = 1) -> None:
        self.bar.update(n)
        self.beat()
