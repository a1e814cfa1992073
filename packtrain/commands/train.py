"""`packtrain train CONFIG [--set k=v ...] [--resume | --overwrite]`."""

from __future__ import annotations

from packtrain.config import load_config
from packtrain.distributed import apply_launcher_settings, shutdown
from packtrain.rundir import overrides
from packtrain.rundir.directory import OUTPUTS
from packtrain.rundir.disk import (
    check_not_an_input,
    check_writable,
    config_inputs,
    left_untouched_if_refused,
    output_errors,
)
from packtrain.rundir.overrides import RunOverrides


def run_train(args) -> int:
    from packtrain.run.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    runs = RunOverrides(given=list(args.overrides))
    if args.resume:  # the run continues as it was started: its recorded --set overrides, then this command's
        runs = overrides.combine(overrides.read(cfg.output_path), args.overrides)
        if runs.kept:
            cfg = load_config(args.config, runs.all)
    apply_launcher_settings(cfg)  # accelerate's own config, where packtrain has an equivalent
    out = cfg.output_path
    check_not_an_input(out, "output_dir", config_inputs(cfg, args.config))
    # and no data, model or tokenizer where train writes (the config may be a run's own config.yaml: a resume)
    check_not_an_input(out, "output_dir", config_inputs(cfg), writes=OUTPUTS)
    try:
        # Trainer closes its ops hooks (watchdog, wandb), signal handlers and the output_dir lock itself
        with output_errors(out), left_untouched_if_refused(out):  # a full or read-only output_dir: one line naming
            check_writable(out)  # the path, not a traceback; a refusal before any output: no empty output_dir left
            Trainer(cfg, resume=args.resume, overwrite=args.overwrite, overrides=runs).train()
    finally:
        shutdown()
    return 0
