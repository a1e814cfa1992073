"""packtrain's generation against transformers' ``generate``, one run, side by side (docs/performance.md, "Generation").

Three ways to generate the same greedy answers with the same model (configs/demo.yaml's model and LoRA, random
weights, float32, one thread):
- packtrain: P prefilled once per prompt group, the items as continuations of one pack, every row decoded in one
  batch (``packtrain.run.generate.generate``, what `packtrain eval --generate` runs);
- one at a time: ``model.generate`` on each ``concat(P, item)`` alone;
- batched: ``model.generate`` on all items of one P at once, left-padded (P computed once per row).

Shapes: ``demo`` (data/demo/eval.jsonl: 60 examples, 5 prompts of 315-382 tokens, items of ~11 tokens, 8 new tokens)
and ``long`` (P of 1,024 tokens, 24 items of 40-80 tokens, 16 new tokens). No stop token, so every way generates the
same number of tokens. The ways run interleaved ``--repeats`` times; the table gives the median seconds and each
way's ratio to packtrain, and how many packtrain answers equal the one-at-a-time ones.

    python tools/bench/generate.py            # both shapes
    python tools/bench/generate.py --shape long --repeats 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from packtrain.config import load_config
from packtrain.data.jsonl import Example, load_split
from packtrain.data.planner import plan_packs
from packtrain.distributed import DistInfo
from packtrain.models.build import apply_lora, build_base_model
from packtrain.packed.kernels import select_backend
from packtrain.packed.lm import PackedLM
from packtrain.packed.patch import patch_model
from packtrain.run.generate import GenerateSpec, generate
from packtrain.run.units import Kinds

ONE = DistInfo(0, 1, 0, torch.device("cpu"))


def demo_shape(cfg):
    return load_split(cfg, "eval"), 8


def long_shape(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prefix = tuple(rng.randrange(3, vocab) for _ in range(1024))
    items = [tuple(rng.randrange(3, vocab) for _ in range(rng.randint(40, 80))) for _ in range(24)]
    return [Example(f"long-{i}", prefix, item, (1,)) for i, item in enumerate(items)], 16


def packtrain_way(lm, examples, new):
    plan = plan_packs(examples, token_budget=1 << 20, max_continuations=len(examples))
    out = generate(lm, plan, examples, Kinds.named("shared_prefix"), GenerateSpec(new, frozenset()), ONE)
    return [list(out[i].ids) for i in range(len(examples))]


def one_at_a_time(model, examples, new):
    answers = []
    for ex in examples:
        ids = torch.tensor([list(ex.prefix_ids) + list(ex.item_ids)])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        answers.append(out[0, ids.shape[1]:].tolist())
    return answers


def batched(model, examples, new):
    groups: dict[tuple, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(tuple(ex.prefix_ids), []).append(i)
    answers = [None] * len(examples)
    for rows in groups.values():
        seqs = [list(examples[i].prefix_ids) + list(examples[i].item_ids) for i in rows]
        width = max(map(len, seqs))
        ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        for r, i in enumerate(rows):
            answers[i] = out[r, width:].tolist()
    return answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["demo", "long", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs" / "demo.yaml")
    model = apply_lora(build_base_model(cfg), cfg).eval()
    lm = PackedLM(patch_model(model, select_backend("torch", "cpu"))).eval()
    shapes = {"demo": demo_shape(cfg), "long": long_shape(cfg.model.config["vocab_size"])}
    chosen = list(shapes) if args.shape == "both" else [args.shape]
    ways = {"packtrain": lambda ex, n: packtrain_way(lm, ex, n), "one at a time": lambda ex, n: one_at_a_time(
        model, ex, n), "batched (left-padded)": lambda ex, n: batched(model, ex, n)}
    print(f"torch {torch.__version__}, 1 thread, model: configs/demo.yaml (random weights, LoRA), float32, greedy")
    print("| shape | way | median s | vs packtrain | answers equal to one at a time |")
    print("|---|---|---|---|---|")
    with torch.no_grad():
        for name in chosen:
            examples, new = shapes[name]
            times = {w: [] for w in ways}
            answers = {}
            for _ in range(args.repeats):
                for w, run in ways.items():
                    t0 = time.perf_counter()
                    answers[w] = run(examples, new)
                    times[w].append(time.perf_counter() - t0)
            base = statistics.median(times["packtrain"])
            for w in ways:
                med = statistics.median(times[w])
                same = sum(a == b for a, b in zip(answers[w], answers["one at a time"]))
                print(f"| {name} ({len(examples)} examples, {new} new tokens) | {w} | {med:.2f} | "
                      f"{med / base:.2f}x | {same}/{len(examples)} |")


if __name__ == "__main__":
    main()
