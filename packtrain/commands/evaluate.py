"""`packtrain eval CONFIG --adapter DIR --out FILE.jsonl`: one ``{"id", "loss", "target_tokens"}`` line per example,
packed by default, standalone with ``--set packing.mode=standalone``. Uses data.eval, else data.train."""

from __future__ import annotations

import json
from pathlib import Path

from packtrain.config import load_config
from packtrain.distributed import init_distributed, shutdown


def run_eval(args) -> int:
    from peft import PeftModel

    from packtrain.data.examples import load_split
    from packtrain.data.planner import plan_for
    from packtrain.models.build import build_base_model
    from packtrain.packed.kernels import select_backend
    from packtrain.packed.lm import PackedLM
    from packtrain.packed.patch import patch_model
    from packtrain.run.evaluate import evaluate, mean_loss
    from packtrain.run.units import UnitSetup, image_loader

    cfg = load_config(args.config, args.overrides)
    adapter = Path(args.adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise ValueError(f"--adapter: {adapter} is not a PEFT adapter directory (no adapter_config.json)")
    split = "eval" if cfg.data.eval else "train"
    examples = load_split(cfg, split)
    if examples is None:
        raise ValueError("data.eval and data.train are both unset: nothing to evaluate")
    info = init_distributed(cfg.train.device, cfg.ops.collective_timeout)
    try:
        model = PeftModel.from_pretrained(build_base_model(cfg), adapter, is_trainable=False)
        backend = select_backend(cfg.model.kernels, info.device)
        lm = PackedLM(patch_model(model, backend), cfg.packing.context_grad).to(info.device)
        setup = UnitSetup(cfg.packing.mode, walk_spec=cfg.walk_spec(), images=image_loader(cfg, model, examples))
        rows = evaluate(lm, plan_for(cfg, examples), examples, setup, info)
        if info.is_main:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("".join(json.dumps(r) + "\n" for r in rows))
            print(f"packtrain eval: {len(rows)} examples of data.{split}, mode {cfg.packing.mode}, "
                  f"context_grad {cfg.packing.context_grad}, kernels {backend.describe()}: mean loss {mean_loss(rows):.4f} -> {out}")
    finally:
        shutdown()
    return 0
