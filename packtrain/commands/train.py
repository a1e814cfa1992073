"""`packtrain train CONFIG [--set k=v ...] [--resume]`."""

from __future__ import annotations

from packtrain.config import load_config
from packtrain.distributed import shutdown


def run_train(args) -> int:
    from packtrain.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    try:
        Trainer(cfg, resume=args.resume).train()  # closes its ops hooks (watchdog, wandb) itself
    finally:
        shutdown()
    return 0
