"""``train --resume``: which checkpoint to continue from, and whether it belongs to the same run.

The newest checkpoint can be damaged (a disk that filled up, a copy cut short), and a resume with another
``optim.lr``, ``train.seed`` or edited system prompts would be another run under the old run's name:

- :func:`choose_checkpoint`: rank 0 verifies checkpoints newest first (digests, then every file read as a resume
  reads it, see :func:`packtrain.rundir.checkpoint.verify_checkpoint`); a damaged one is reported and the next older one
  tried. Every rank receives rank 0's choice. Only once the resume is accepted (:func:`check_same_run`,
  :func:`check_steps`) are the damaged ones renamed to ``checkpoints/damaged-step-N`` (:func:`set_aside`: evidence,
  out of the way of the steps the run writes again); a refused resume moves nothing.
- :func:`check_steps`: a resume never goes back, and never starts a finished run again: a run whose final adapter is
  from its last step is reported finished (exit 0, nothing trained). A run whose newest valid
  checkpoint, or whose final adapter, is past the config's total of steps (``train.max_steps`` lowered) is refused
  naming both numbers: continuing would have trained nothing and replaced the final adapter with an earlier one,
  with exit 0. A run with a final adapter and no checkpoint (``train.save_every`` over its steps) is refused in one
  line, rather than started again from step 0 over its finished adapter.
- :func:`check_same_run`: the checkpoint stores the resolved config. Keys that change the trajectory
  (:data:`TRAJECTORY`) must be equal, else the resume is refused listing every difference; the others (epochs,
  max_steps, save_every, eval_every, keep_checkpoints, max_nonfinite_skips, logging, ops, device, kernels, data
  paths, ...) may change and are reported. ``train.epochs`` / ``train.max_steps`` fix the number of steps a cosine
  schedule spans, so with ``optim.schedule: cosine`` they may change only if the total number of steps stays the
  same (the learning rate would jump otherwise); with ``constant`` they extend or shorten the run freely. The plan
  fingerprint covers the tokens of every P, item and target, so edited data is refused too, and the weights'
  fingerprint every example's and pair's ``weight`` (which the objective multiplies its loss by).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from packtrain.distributed import DistInfo
from packtrain.exits import Finished
from packtrain.rundir.checkpoint import CheckpointDamaged, checkpoints, final_adapter_step, verify_checkpoint
from packtrain.rundir.directory import RunDirError

# Dotted prefixes whose values fix the sequence of updates; the longest matching entry of TRAJECTORY / FREE wins.
# The training data is compared by its tokens (the plan fingerprint), not by path: data.train, data.format and
# data.tokenizer may change (a moved file, the same tokenizer elsewhere) as long as every token is the same.
# The packs per step are compared as the run used them (train.packs_per_rank x the world size, or
# train.packs_per_step): the same count from the other key, or from packs_per_rank at another world size, is the same
# run.
TRAJECTORY = ("model", "data.processor", "packing", "lora", "optim", "train.seed", "train.max_positions",
              "train.balance", "train.cost_per_position", "train.cost_per_pair", "train.objective", "train.dpo_beta",
              "train.dpo_loss_type", "train.rpo_alpha")
# Same updates, computed elsewhere or differently: kernels and device change float rounding, not the run.
FREE = ("model.kernels",)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "config":  # model.config is one value: a transformers config
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _rule(key: str, table: tuple[str, ...]) -> int:
    """Length of the longest entry of ``table`` that is ``key`` or a dotted prefix of it (0: none)."""
    return max((len(p) for p in table if key == p or key.startswith(p + ".")), default=0)


def is_trajectory(key: str) -> bool:
    return _rule(key, TRAJECTORY) > _rule(key, FREE)


def compare(saved: dict, now: dict, saved_steps: int, now_steps: int) -> tuple[list[str], list[str]]:
    """(refused differences, allowed differences), each ``key: old -> new``."""
    a, b = _flatten(saved), _flatten(now)
    refused, allowed = [], []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key, "(absent)"), b.get(key, "(absent)")
        if old == new:
            continue
        line = f"{key}: {old!r} -> {new!r}"
        (refused if is_trajectory(key) else allowed).append(line)
    if b.get("optim.schedule") == "cosine" and saved_steps != now_steps:
        refused.append(f"total steps: {saved_steps} -> {now_steps} (train.epochs / train.max_steps: the cosine "
                       "schedule spans the run's steps, so its learning rate would jump)")
    return refused, allowed


def saved_packs_per_step(state: dict) -> int:
    """The packs per step of the run that wrote ``state``; a checkpoint written before train.packs_per_rank has
    only the global train.packs_per_step in its config."""
    if "packs_per_step" in state:
        return state["packs_per_step"]
    t = state["config"]["train"]
    return t.get("packs_per_step") or t.get("packs_per_rank", 1) * state["world_size"]


def check_same_run(state: dict, cfg_dict: dict, plan_fingerprint: str, total_steps: int, ckpt: Path,
                   log, weights_fingerprint: str | None = None, packs_per_step: int | None = None) -> None:
    refused, allowed = compare(state["config"], cfg_dict, state["total_steps"], total_steps)
    saved = saved_packs_per_step(state)
    if packs_per_step is not None and saved != packs_per_step:
        refused.append(f"packs per step: {saved} (written at world size {state['world_size']}) -> {packs_per_step} "
                       f"(train.packs_per_rank x the world size, or train.packs_per_step): the steps would hold other "
                       f"packs; set train.packs_per_step: {saved} (in place of train.packs_per_rank) to continue this "
                       "run at this world size")
    # a checkpoint from before the weights' fingerprint has none: its weights cannot be compared
    if state.get("weights") is not None and state["weights"] != weights_fingerprint:
        refused.append('training data: the examples\' or pairs\' "weight" values differ from the run that wrote the '
                       "checkpoint (the loss multiplies by them)")
    if state["plan"] != plan_fingerprint:
        if any(line.startswith("packing.") for line in refused):  # those settings make other packs of the same data
            refused.append("training data: the packs differ from the run that wrote the checkpoint (the packing "
                           "settings above make other packs; the tokens may differ too)")
        else:
            refused.append("training data: the tokens of the system prompts, items or targets (or the packs) "
                           "differ from the run that wrote the checkpoint")
    if refused:
        raise RunDirError(f"resume refused: {ckpt} belongs to another run; these differ and change what is "
                          "trained:\n  " + "\n  ".join(refused)
                          + "\nset them back, or start a new run (another output_dir, or --overwrite)")
    if allowed:
        log("resume: changed since the checkpoint (allowed):\n  " + "\n  ".join(allowed))


def check_steps(out: Path, resumed_step: int, ckpt: Path | None, total_steps: int, info: DistInfo) -> None:
    """Refuse a resume that would go back: the newest valid checkpoint (``ckpt``, at ``resumed_step``) or the final
    adapter is past ``total_steps``; or that would start a finished run again: a final adapter and no checkpoint
    (``ckpt`` None) to continue from. Rank 0 reads the adapter's step; every rank gets it (one verdict for all)."""
    final = [(final_adapter_step(out), (Path(out) / "adapter").exists()) if info.is_main else None]
    if info.enabled:
        dist.broadcast_object_list(final, src=0)
    final, finished = final[0]
    if final == total_steps and resumed_step <= total_steps:
        further = ("raise train.max_steps or train.epochs" if ckpt is not None else
                   "start a new run from its adapter (model.adapter): it saved no checkpoint to continue from")
        raise Finished(f"{out} is finished: its final adapter {Path(out) / 'adapter'} is from step {final} of "
                       f"{total_steps}; nothing to train (to train further, {further})", quiet=not info.is_main)
    if ckpt is None and finished:
        trained = f"step {final}" if final is not None else "its last step"
        raise RunDirError(f"resume refused: {out} holds a finished run (its final adapter {Path(out) / 'adapter'} is "
                          f"from {trained}) and no checkpoint to continue from, so a resume would train it again "
                          f"from step 0 and replace that adapter: start a new run (another output_dir, or "
                          f"--overwrite); to train it further, save checkpoints (train.save_every below its steps)")
    past = []
    if ckpt is not None and resumed_step > total_steps:
        past.append(f"its newest valid checkpoint is step {resumed_step} ({ckpt})")
    if final is not None and final > total_steps:
        past.append(f"its final adapter is from step {final} ({Path(out) / 'adapter'})")
    if past:
        reach = max(resumed_step, final or 0)
        raise RunDirError(f"resume refused: this config trains {total_steps} steps, and {out} is past that: "
                          f"{'; '.join(past)}. A resume continues a run and never goes back (the final adapter "
                          f"would be replaced by an earlier one): set train.max_steps / train.epochs to at least "
                          f"{reach}, or start a new run (another output_dir, or --overwrite)")


def _verified(out: Path, log) -> tuple[str | None, dict | None, list[str], list[str]]:
    problems, damaged = [], []
    for ckpt in checkpoints(out):
        try:
            state = verify_checkpoint(ckpt)
        except CheckpointDamaged as e:
            problems.append(str(e))
            damaged.append(str(ckpt))
            log(f"resume: {ckpt.name} is damaged: {e}")
            continue
        return str(ckpt), state, problems, damaged
    return None, None, problems, damaged


def choose_checkpoint(out: Path, info: DistInfo, log) -> tuple[Path, dict, list[Path]] | None:
    """The newest valid checkpoint, its state and the damaged ones newer than it, the same on every rank; None
    when there is none at all. Raises :class:`RunDirError` when checkpoints exist but every one is damaged."""
    chosen = [None, None, [], []]
    if info.is_main:
        chosen = list(_verified(Path(out), log))
    if info.enabled:
        dist.broadcast_object_list(chosen, src=0)
    path, state, problems, damaged = chosen
    if path is None and problems:
        raise RunDirError("resume: every checkpoint is damaged:\n  " + "\n  ".join(problems)
                          + "\nstart over with --overwrite")
    return (Path(path), state, [Path(d) for d in damaged]) if path is not None else None


def set_aside(damaged: list[Path], chosen: Path, info: DistInfo, log) -> None:
    """Rank 0 renames the damaged checkpoints to ``damaged-step-N``, once the resume from ``chosen`` is accepted."""
    if not info.is_main:
        return
    for bad in damaged:
        aside = bad.parent / f"damaged-{bad.name}"
        if aside.exists():
            shutil.rmtree(aside)
        bad.rename(aside)
        log(f"resume: moved {bad.name} to {aside.name}; falling back to {chosen.name}")
