"""`packtrain pretune-fla CONFIG [--prompt-tokens N] [--out DIR]`: tune fla's Triton kernels on a short update and
pin the winners, so the full-length run never autotunes.

One process on one GPU, with ``FLA_CACHE_MODE`` unset (so Triton searches): the largest pack with P cut to
``--prompt-tokens`` tokens runs one update; every fla kernel Triton tuned is written as ``{kernel}.json`` with a
``default_config`` (:mod:`packtrain.ops.fla_tune`) to ``--out`` (default ``OUTPUT/fla-configs/<GPU name>``). Then
launch every rank with the printed ``FLA_CACHE_MODE=default FLA_CONFIG_DIR=...``; check-nodes shows each rank's
pinned-config digest. GPUs of another model need their own run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from packtrain.config import load_config
from packtrain.distributed import init_distributed, shutdown
from packtrain.ops import fla_tune


def _require_gpu_and_fla() -> None:
    import torch

    from packtrain.packed.kernels import fla_available

    if not torch.cuda.is_available() or not fla_available():
        raise ValueError("pretune-fla needs a CUDA GPU and the fla package (pip install 'packtrain[gpu]'): "
                         "it runs fla's Triton kernels to tune them")
    mode = os.environ.get(fla_tune.ENV_MODE, "disabled")
    if mode != "disabled":
        raise ValueError(f"{fla_tune.ENV_MODE}={mode}: unset it for pretune-fla, so that Triton searches instead of "
                         "reading configs")


def format_tuned(tuned: dict, plain: list[str]) -> str:
    lines = [f"  {'kernel':<34} {'keys tuned':>10}  pinned config"]
    for kernel in sorted(tuned):
        key, entry = fla_tune.choose_default(tuned[kernel])
        shown = f"{entry['kwargs']} warps {entry['num_warps']} stages {entry['num_stages']} (key {list(key)})"
        lines.append(f"  {kernel:<34} {len(tuned[kernel]):>10}  {shown}")
    if plain:
        lines.append(f"  tuned by plain triton.autotune, which FLA's cache cannot pin: {', '.join(plain)}")
    return "\n".join(lines)


def run_pretune_fla(args) -> int:
    _require_gpu_and_fla()
    import torch
    import triton

    from packtrain.run.harness import one_pack, one_update, update_step
    from packtrain.run.session import open_session

    cfg = load_config(args.config, args.overrides)
    info = init_distributed("cuda", cfg.ops.collective_timeout)
    try:
        if info.enabled:
            raise ValueError("pretune-fla runs in one process on one GPU (run it without a launcher)")
        # the run's setup (packtrain/run/session.py), each pack one call (no groups); the run's savings, whose
        # kernels it tunes
        session = open_session(cfg, info, "train", n_groups=1)
        session.build_model()
        if not session.backend.fla:
            raise ValueError(f"model.kernels={cfg.model.kernels} selected {session.backend.describe()}: pretune-fla "
                             "tunes the fla kernels (model.kernels: fla or auto)")
        cfg = session.run_cfg
        one, _ = one_pack(session.plan, session.examples, session.kinds, cfg.train.max_positions, args.prompt_tokens)
        one_update(update_step(cfg, session.lm, session.kinds, one, session.examples, info, steps=1))
        torch.cuda.synchronize()
    finally:
        shutdown()
    tuned, plain = fla_tune.collect_tuned()
    if not tuned:
        raise ValueError("no fla kernel was autotuned during the update (were they tuned from a cache?)")
    gpu = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else cfg.output_path / "fla-configs" / re.sub(r"[^0-9A-Za-z]+", "_", gpu)
    written = fla_tune.write_fla_configs(out, tuned, gpu, triton.__version__)
    print(f"pretune-fla: one update of {one.packs[0].positions:,} positions (P cut to {args.prompt_tokens} tokens) on {gpu}")
    print(format_tuned(tuned, plain))
    print(f"wrote {len(written)} files to {out}")
    print(f"launch every rank with:\n  {fla_tune.launch_env(out)}")
    return 0
