"""Finite or stop: a step whose loss or gradient norm is NaN or inf makes no update.

Why: without it a diverged run keeps writing NaN checkpoints and a NaN adapter and still exits 0. The loss is summed over ranks and the gradient norm is global under FSDP, so
every rank already holds the same two numbers; the trainer still agrees on the verdict through the step's one
all-reduce of flags (:data:`NONFINITE`), so no rank can take another path. Up to ``train.max_nonfinite_skips``
such steps are skipped (no update, counted in metrics.jsonl); the next one stops the run with
:class:`~packtrain.exits.NonFiniteError` before anything is written, so the last checkpoint stays the last good one.
"""

from __future__ import annotations

import math

import torch

from packtrain.distributed import DistInfo, all_reduce_max_tensor
from packtrain.exits import NonFiniteError


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def describe(loss: float, grad_norm: float) -> str:
    return f"loss {loss!r}, gradient norm {grad_norm!r}"


def stop_message(step: int, loss: float, grad_norm: float, cfg, last_checkpoint: str | None, skips: int) -> str:
    o = cfg.optim
    kept = (f"the last good checkpoint, {last_checkpoint}, is intact" if last_checkpoint
            else "no checkpoint was written yet")
    skipped = f" after {skips} skipped non-finite step(s)" if skips else ""
    dtype = ", model.dtype float32 instead of bfloat16" if cfg.model.dtype == "bfloat16" else ""
    return (f"step {step}: {describe(loss, grad_norm)}{skipped}: stopped before the update, nothing written "
            f"({kept}). Try, in a new run (--overwrite or another output_dir): a lower optim.lr (now {o.lr:g}), "
            f"optim.max_grad_norm (now {o.max_grad_norm}), more optim.warmup_steps (now {o.warmup_steps}){dtype}; "
            f"or check this step's data; or skip such steps: --resume --set train.max_nonfinite_skips=N "
            f"(now {cfg.train.max_nonfinite_skips})")


def check_parameters(params, info: DistInfo, step: int) -> None:
    """Before a save: every rank checks its shards of the trainable parameters, and all agree (one all-reduce)."""
    bad = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        if not bool(torch.isfinite(local.detach()).all()):
            bad = 1
            break
    flag = all_reduce_max_tensor(torch.tensor([bad], dtype=torch.int64, device=info.device), info)
    if int(flag[0]):
        raise NonFiniteError(f"step {step}: a trainable parameter is NaN or inf; nothing was saved (the last "
                             "checkpoint is the last good one)", quiet=not info.is_main)
