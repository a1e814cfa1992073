"""`packtrain train CONFIG [--set k=v ...] [--resume | --overwrite]`."""

from __future__ import annotations

from packtrain.config import load_config
from packtrain.distributed import shutdown


def run_train(args) -> int:
    from packtrain.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    try:
        # closes its ops hooks (watchdog, wandb), signal handlers and the output_dir lock itself
        Trainer(cfg, resume=args.resume, overwrite=args.overwrite).train()
    finally:
        shutdown()
    return 0
