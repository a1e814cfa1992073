"""The seed's pack on a GPU, its memory per phase against `plan --memory --measure` and the estimate.

Qwen3.6-27B's widths with 2 decoder layers (one GDN, one attention) and its vocabulary, bf16, LoRA r 8 with dropout
0.05 on q, k, v, o and gate_proj, checkpointing + offload, one rank; the pack is P 64,000 + 80 continuations of
400-700 item and 200-400 target tokens (tools/data/make_seed_data.py). The step runs for real on CUDA
(packtrain's kernels: fla, FlexAttention) through the harness's update, and torch.cuda.max_memory_allocated is read
at each phase's end (the phases of packtrain.memory.measure: forward, loss, each layer kind's recompute, optimizer). The
memory verdict of tools/gpu_check.sh 2 is :func:`cuda_phases` against --measure (tools/gpu/verdicts.py); by hand
this prints the three side by side and writes $OUT/gpu_memory.json.

    python tools/gpu/memory_check.py [--prefix 64000] [--continuations 80]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))

from make_seed_data import seed_records

from packtrain.config import load_config
from packtrain.data.jsonl import load_split
from packtrain.memory import estimate as memory
from packtrain.models.text_config import config_dict_of, text_config
from packtrain.run.units import plan_for, unit_shape

REPO = Path(__file__).resolve().parents[2]


class CudaPhases:
    """The interface packtrain.memory.measure's phase hooks drive, over the CUDA allocator's peak: each phase's peak is
    max_memory_allocated from its start to the next phase's start."""

    def __init__(self, device):
        self.device, self.peaks, self.layer, self._phase = device, {}, None, None

    def _close(self):
        if self._phase is not None:
            name = "forward" if self._phase == "_layer" else self._phase  # a layer's own forward is the forward's
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def set_phase(self, name):
        self._close()
        self._phase = name

    phase = property(lambda self: self._phase, set_phase)

    def activations(self):
        return torch.cuda.memory_allocated(self.device)

    def host(self):
        return 0

    def owned(self, layer, but=None):
        return 0

    def tag_index(self, tensors):  # the allocator's figure holds everything; nothing is set apart
        pass


def write_config(tmp: Path, prefix: int, continuations: int) -> Path:
    base = yaml.safe_load((REPO / "configs" / "qwen3.6-27b.yaml").read_text())
    text = dict(base["model"]["config"])
    text.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    data = tmp / "seed.jsonl"
    with data.open("w") as f:
        for record in seed_records(prefix, continuations, text["vocab_size"], 0):
            f.write(json.dumps(record) + "\n")
    # every saving given (the config leaves them auto): the figures compared are of one fixed step
    train = {**base["train"], "activation_checkpointing": True, "offload": True, "loss_chunk_rows": 256,
             "mlp_chunk_rows": 8192, "norm_chunk_rows": 8192}
    cfg = {**base, "model": {**base["model"], "config": text}, "output_dir": str(tmp / "run"), "train": train,
           "data": {"train": str(data), "format": "pretokenized"},
           "packing": {**base["packing"], "token_budget": 200_000, "max_continuations": 500}}
    path = tmp / "cfg.yaml"
    path.write_text("# python tools/gpu/memory_check.py\n" + yaml.safe_dump(cfg))
    return path


def cuda_phases(cfg, plan, examples) -> dict[str, int]:
    from packtrain.distributed import DistInfo
    from packtrain.memory.measure import phase_hooks
    from packtrain.models.build import build_base_model
    from packtrain.models.wrap import assemble
    from packtrain.packed.patch import text_parts
    from packtrain.run.harness import on_every_rank, one_pack, update_step
    from packtrain.run.units import Kinds

    device = torch.device("cuda")
    with device:
        base = build_base_model(cfg)
    model, lm, _ = assemble(base, cfg, device)
    text = text_config(config_dict_of(cfg))
    text_model, _ = text_parts(model)
    layers = list(text_model.layers)
    setup = Kinds.of(cfg)
    one, _ = one_pack(plan, examples, setup, cfg.train.max_positions)
    step = update_step(cfg, lm, setup, one, examples, DistInfo(0, 1, 0, device))
    optimizer = step.optimizer
    ready = step.prepare(on_every_rank(step))  # built before the phases, as --measure builds it
    from packtrain.memory.measure import LayerRecord

    counter = CudaPhases(device)
    records = [LayerRecord(tuple(k)) for k in text["kinds"]]
    hooks = phase_hooks(counter, layers, records, text, True, text_model.norm)
    hooks.append(optimizer.register_step_pre_hook(lambda *_: counter.set_phase("optimizer")))
    counter.set_phase("forward")
    step.update(ready, 0)
    counter.set_phase(None)
    for h in hooks:
        h.remove()
    return counter.peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=64_000)
    ap.add_argument("--continuations", type=int, default=80)
    args = ap.parse_args()
    from packtrain.memory.measure import measure_whole
    from packtrain.run.harness import measure_step

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(write_config(Path(tmp), args.prefix, args.continuations))
        examples = load_split(cfg, "train")
        plan = plan_for(cfg, examples)
        est = memory.estimate_for_unit(cfg, unit_shape(cfg, plan, examples), 1)
        measured = measure_whole(cfg, measure_step(cfg, plan, examples), 1)
        cuda = cuda_phases(cfg, plan, examples)
    rows = {p: {"estimate": est.phases.get(p), "measured": measured.phases.get(p), "cuda": cuda.get(p)}
            for p in dict.fromkeys([*est.phases, *measured.phases, *cuda])}
    print(f"{'phase':<32}{'estimate':>10}{'measured':>10}{'cuda':>10}  (GiB; cuda: max_memory_allocated)")
    for p, r in rows.items():
        print(f"{p:<32}" + "".join(f"{'' if v is None else f'{v / memory.GiB:.2f}':>10}" for v in r.values()))
    out = Path(os.environ.get("OUT", "/tmp/gpu_check"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_memory.json").write_text(json.dumps({"phases": rows, "savings": est.savings.describe()}, indent=1))


if __name__ == "__main__":
    main()
