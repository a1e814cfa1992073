"""Weights & Biases mirror of metrics.jsonl (``logging.wandb: off | offline | online``, default off).

metrics.jsonl stays the record: the mirror gets the same dicts after they are written, from rank 0 only, train
lines under ``train/`` and eval lines under ``eval/``, both at the record's optimizer step. wandb is an optional
extra (``pip install 'packtrain[wandb]'``), imported only when asked for. The run id is kept in
``OUTPUT/wandb-run-id`` so ``train --resume`` continues the same wandb run.
"""

from __future__ import annotations

import importlib
from pathlib import Path

NOT_LOGGED = ("step", "split")


def require_wandb(mode: str):
    """The wandb module; every rank calls this, so a missing package stops all of them, not rank 0 alone."""
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise ValueError(f"logging.wandb={mode} but the wandb package is not installed "
                         "(pip install 'packtrain[wandb]', or logging.wandb: off)") from None


class WandbMirror:
    def __init__(self, mode: str, project: str, out_dir: Path, config: dict):
        wandb = require_wandb(mode)
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        id_file = out_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, mode=mode, dir=str(out_dir), id=run_id, resume="allow",
                              name=out_dir.resolve().name, config=config)

    def log(self, record: dict) -> None:
        prefix = record.get("split") or "train"  # train/..., eval/loss, generate/mean_score
        values = {f"{prefix}/{k}": v for k, v in record.items()
                  if k not in NOT_LOGGED and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log(values, step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()
