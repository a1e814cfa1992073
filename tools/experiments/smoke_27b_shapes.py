"""A Qwen3.6-27B-shaped load and update on CPU: the released layer shapes with 2 decoder layers, bf16, sharded.

    python tools/experiments/smoke_27b_shapes.py [--work DIR] [--ranks 2] [--keep]

Writes a random checkpoint with Qwen3.6-27B's exact layer shapes (hidden 5,120; Gated DeltaNet 16 key / 48 value
heads of 128; attention 24 / 4 heads of 256 with the output gate (always on in Qwen3.5's q_proj); intermediate 17,408; vocabulary 248,320;
untied embeddings) but 2 decoder layers (1 GDN + 1 attention), bf16, in safetensors shards of 2 GB with an index
and no tokenizer, plus a pre-tokenized 2K-position pack; then runs `packtrain train` for one update on N gloo
ranks and prints each rank's peak host memory (VmHWM, polled from this process, and the largest
``ru_maxrss`` of the waited-for ranks) next to ``plan --memory``'s terms for that model. Needs about
7 GB of disk and, with 2 ranks, about 2 x 9 GB of memory. Not a CI test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TEXT = {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
GiB = 2**30
# what `packtrain train` runs before step 0: build on the meta device, LoRA, patch, checkpointing, FSDP, fill
LOAD_ONLY = """
import sys
from packtrain.config import load_config
from packtrain.distributed import init_distributed, shutdown
from packtrain.models.build import build_base_model
from packtrain.models.wrap import assemble
cfg = load_config(sys.argv[1])
info = init_distributed("cpu")
_, lm, _ = assemble(build_base_model(cfg, meta=True), cfg, info.device, shard=info.enabled)
print("packtrain train (load only):", lm.load_report.describe())
shutdown()
"""


def write_checkpoint(path: Path, shard_bytes: int = 2 * GiB) -> int:
    """Random bf16 tensors for every parameter of the class, written shard by shard (never the whole model)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from packtrain.models.build import empty_model, model_class_for

    raw = dict(TEXT)
    model_type = raw.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **raw)
    meta = empty_model(model_class_for(model_type), hf_config, torch.bfloat16)
    path.mkdir(parents=True)
    hf_config.save_pretrained(path)
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    shards, current, size = [], {}, 0
    for key, shape in shapes.items():
        n = torch.Size(shape).numel() * 2
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = shape
        size += n
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: torch.randn(s, generator=gen, dtype=torch.bfloat16).mul_(0.02) for k, s in shard.items()}
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * 2 for t in tensors.values())
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def write_data(path: Path) -> None:
    """One pack of 2,048 positions: a 1,024-token P and 4 continuations of 224 + 32 tokens (few targets: the
    head's logits are [targets, 248,320])."""
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 248000) for _ in range(1024)]
    lines = [{"id": f"ex{i}", "prefix_ids": prefix, "item_ids": [rng.randrange(1000, 248000) for _ in range(224)],
              "target_ids": [rng.randrange(1000, 248000) for _ in range(32)]} for i in range(4)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def peak_kib(pid: int) -> int | None:
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
        return int(m.group(1)) if m else None
    except OSError:
        return None


def rank_pids(parent: int) -> list[int]:
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return []
    return [int(c) for c in children]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/smoke-27b-shapes", help="folder for the checkpoint, data and run")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the 7 GB checkpoint afterwards")
    parser.add_argument("--load-only", action="store_true", help="only build, wrap and fill the model on each rank "
                        "(what `train` does before step 0), no update")
    args = parser.parse_args()
    work = Path(args.work).resolve()
    ckpt = work / "checkpoint"
    t0 = time.time()
    if not (ckpt / "model.safetensors.index.json").is_file():
        shutil.rmtree(ckpt, ignore_errors=True)
        size = write_checkpoint(ckpt)
        print(f"wrote {size / GiB:.2f} GiB bf16 in {len(list(ckpt.glob('*.safetensors')))} shards "
              f"({time.time() - t0:.0f} s)", flush=True)
    size = json.loads((ckpt / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    write_data(work / "train.jsonl")
    config = {"model": {"path": str(ckpt), "dtype": "bfloat16", "kernels": "torch"},
              "data": {"train": str(work / "train.jsonl"), "format": "pretokenized"},
              "packing": {"token_budget": 2048, "max_continuations": 4},
              "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
              "optim": {"name": "adamw", "lr": 1e-4, "warmup_steps": 0},
              "train": {"max_steps": 1, "packs_per_step": 1, "activation_checkpointing": True, "device": "cpu",
                        "save_every": 1000, "offload": False, "loss_chunk_rows": 256, "mlp_chunk_rows": 0,
                        "norm_chunk_rows": 0},
              "logging": {"progress": False}, "ops": {"check_nodes": False, "hang_timeout": None},
              "output_dir": str(work / "run")}
    cfg_path = work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    shutil.rmtree(work / "run", ignore_errors=True)

    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = ["-m", "packtrain", "train", str(cfg_path)]
    if args.load_only:
        (work / "load_only.py").write_text(LOAD_ONLY)
        run = [str(work / "load_only.py"), str(cfg_path)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks), "--master_addr",
           "127.0.0.1", "--master_port", "29517", *run]
    t1 = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}
    output = []
    import threading

    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        for pid in rank_pids(proc.pid):
            kib = peak_kib(pid)
            if kib is not None:
                peaks[pid] = max(peaks.get(pid, 0), kib)
        time.sleep(0.2)
    reader.join()
    largest = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    text = "".join(output)
    print("\n".join(line for line in text.splitlines() if "packtrain train" in line or line.startswith("  ")
                    or "loss" in line.lower() or "error" in line.lower())[-4000:])
    for i, (pid, kib) in enumerate(sorted(peaks.items())):
        print(f"  rank process {i} (pid {pid}): peak RSS {kib / 2**20:.2f} GiB (polled VmHWM)")
    if proc.returncode != 0:
        print(text[-3000:])
        return proc.returncode

    from packtrain.memory.describe import format_table
    from packtrain.memory.estimate import StepSavings, estimate
    from packtrain.models.text_config import text_config

    est = estimate(text_config(TEXT), 2048, 4 * 32, dtype="bfloat16", lora_r=8,
                   lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"], world_size=args.ranks,
                   continuations=4, savings=StepSavings(activation_checkpointing=True, loss_rows=256,
                                                        lora_in_model_dtype=True, masks_regenerated=True))
    print(f"\ncheckpoint {size / GiB:.2f} GiB (bf16, 2 decoder layers of Qwen3.6-27B's shapes); run "
          f"{time.time() - t1:.0f} s on {args.ranks} gloo ranks")
    print(f"  largest rank peak (ru_maxrss of the waited-for ranks): {largest / 2**20:.2f} GiB")
    print(f"  weights share per rank: {size / args.ranks / GiB:.2f} GiB\n")
    print(format_table(est))
    if not args.keep:
        shutil.rmtree(ckpt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
