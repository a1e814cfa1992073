"""Peak memory and time of the walk (packing.on_overflow: walk) against example length, on CPU.

    OMP_NUM_THREADS=1 python tools/bench/walk.py [--lengths 4096 16384 65536] [--chunk 1024] [--standalone 4096]

Each configuration runs in its own child process (one forward+backward of one example: P of 64 tokens and a
continuation of L tokens on a tiny float32 Qwen3.5 hybrid with LoRA); the parent reads the child's peak RSS from
``wait4`` (from outside the process) and the child reports its own wall time. ``--standalone`` adds the whole
example through the model's own forward for comparison (its attention scores grow with L^2: keep it short).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

P = 64


def child(length: int, horizon: str, chunk: int) -> None:
    import random

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from packtrain.data.walk_calls import WalkSpec, walk_calls
    from packtrain.packed.kernels import Backend
    from packtrain.packed.layout import Continuation, build_standalone_layout
    from packtrain.packed.lm import PackedLM, StandaloneCall
    from packtrain.packed.patch import patch_model
    from packtrain.packed.walk import train_walk

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False)
    model = get_peft_model(Qwen3_5ForCausalLM(cfg), LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv"]))
    lm = PackedLM(patch_model(model, Backend(gdn="torch", attention="batched")))
    rng = random.Random(0)
    prefix = [rng.randrange(1024) for _ in range(P)]
    cont = Continuation([rng.randrange(1024) for _ in range(length // 2)],
                        [rng.randrange(1024) for _ in range(length - length // 2)])
    layout = build_standalone_layout(prefix, cont)
    t0 = time.perf_counter()
    if horizon == "standalone":
        lm(StandaloneCall(layout)).loss_sum.backward()
    else:
        spec = WalkSpec(chunk, None if horizon == "all" else int(horizon))
        train_walk(lm, layout, spec, 1.0, walk_calls(P, len(cont.item_ids), length, spec))
    print(json.dumps({"seconds": time.perf_counter() - t0}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--horizons", nargs="+", default=["0", "all"])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--standalone", type=int, nargs="*", default=[4096])
    ap.add_argument("--child", nargs=3)
    args = ap.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1], int(args.child[2]))
        return
    runs = [(n, "standalone") for n in args.standalone] + [(n, h) for h in args.horizons for n in args.lengths]
    print(f"| continuation | run | peak RSS (MiB) | seconds |  (P {P}, chunk {args.chunk})")
    print("|---|---|---|---|")
    for n, h in runs:
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(n), h, str(args.chunk)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        assert status == 0, (n, h, status)
        seconds = json.loads(out.strip().splitlines()[-1])["seconds"]
        label = "standalone" if h == "standalone" else f"walk, horizon {h}"
        print(f"| {n:,} | {label} | {usage.ru_maxrss / 1024:.0f} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
