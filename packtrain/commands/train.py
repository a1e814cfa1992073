"""`packtrain train CONFIG [--set k=v ...] [--resume | --overwrite]`."""

from __future__ import annotations

from pathlib import Path

from packtrain.config import load_config
from packtrain.distributed import shutdown
from packtrain.rundir.disk import check_writable, output_errors


def run_train(args) -> int:
    from packtrain.run.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    out = Path(cfg.output_dir)
    try:
        # Trainer closes its ops hooks (watchdog, wandb), signal handlers and the output_dir lock itself
        with output_errors(out):  # a full or read-only output_dir: one line naming the path, not a traceback
            check_writable(out)
            Trainer(cfg, resume=args.resume, overwrite=args.overwrite).train()
    finally:
        shutdown()
    return 0
