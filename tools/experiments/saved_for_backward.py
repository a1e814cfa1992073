"""What one packed forward keeps for backward, by kind: the bytes of the activations autograd holds when the forward
ends (distinct storages, the weights' own left out), on a two-layer hybrid (Gated DeltaNet + attention) at a moderate
width, LoRA r 8 with dropout 0.05 on q, k, v, o and gate_proj. Runs against another checkout too
(``PYTHONPATH=CHECKOUT``; docs/performance.md compares three).

    python tools/experiments/saved_for_backward.py [--hidden 1024 --intermediate 3584 --prefix 2048 \\
        --continuations 8x256]
"""

from __future__ import annotations

import argparse
import random
import weakref
from collections import defaultdict

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from packtrain.packed.kernels import Backend
from packtrain.packed.layout import Continuation, build_pack_layout
from packtrain.packed.lm import PackCall, PackedLM
from packtrain.packed.patch import patch_model

try:
    from packtrain.models import lora_compute  # LoRA in the model's dtype, as apply_lora installs it
except ImportError:  # an older checkout: peft's own forward
    lora_compute = None


def model(args) -> torch.nn.Module:
    heads = args.hidden // 128
    config = Qwen3_5TextConfig(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4), head_dim=128, linear_num_key_heads=heads // 2,
        linear_num_value_heads=heads, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    base = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"])
    model = get_peft_model(base, lora)
    if lora_compute is not None:
        lora_compute.install(model)
    return model


class _Held:
    """A saved tensor, alive as long as the graph that saved it."""

    def __init__(self, t: torch.Tensor):
        self.t = t


def saved_bytes(lm: PackedLM, layout, intermediate: int, top: int) -> dict[str, int]:
    """Bytes of the distinct storages autograd holds at the end of one forward, by kind (and the ``top`` largest
    (shape, dtype) groups)."""
    held = weakref.WeakSet()

    def pack(t):
        h = _Held(t)
        held.add(h)
        return h

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
        out = lm(PackCall(layout))
    weights = {p.untyped_storage().data_ptr() for p in lm.parameters()}  # views of them are no extra memory
    storages = {h.t.untyped_storage().data_ptr(): h.t for h in held}
    storages = {ptr: t for ptr, t in storages.items() if ptr not in weights}
    kinds, groups = defaultdict(int), defaultdict(int)
    for t in storages.values():
        n = t.untyped_storage().nbytes()
        dtype = str(t.dtype).removeprefix("torch.")
        kinds["total"] += n
        kinds[dtype] += n
        if t.shape and t.shape[-1] == intermediate:
            kinds["[rows, intermediate]"] += n
        groups[f"{list(t.shape)} {dtype}"] += n
    del out
    largest = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
    return dict(kinds) | {f"  {k}": v for k, v in largest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3584)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--continuations", default="8x256", help="COUNTxLEN, half item, half target")
    ap.add_argument("--rows", type=int, nargs="*", default=[0, 512],
                    help="the back end's mlp_rows to measure (0: whole)")
    ap.add_argument("--top", type=int, default=0, help="also the N largest (shape, dtype) groups")
    args = ap.parse_args()
    torch.set_num_threads(2)
    count, length = (int(v) for v in args.continuations.split("x"))
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(1024) for _ in range(n)]
    layout = build_pack_layout(tokens(args.prefix), [Continuation(tokens(length // 2), tokens(length - length // 2))
                                                     for _ in range(count)])
    positions = args.prefix + count * length
    lora = "packtrain's LoRA compute" if lora_compute is not None else "peft's LoRA forward"
    print(f"hidden {args.hidden}, intermediate {args.intermediate}, bf16, {positions:,} positions "
          f"(P {args.prefix:,} + {count} x {length}), {lora}; MiB saved for backward at the end of the forward")
    for rows in args.rows:
        lm = PackedLM(patch_model(model(args), Backend(gdn="torch", attention="batched", mlp_rows=rows or None)))
        kinds = saved_bytes(lm, layout, args.intermediate, args.top)
        print(f"  mlp_rows {rows or 'whole':>5}: " + ", ".join(f"{k} {v / 2**20:,.1f}" for k, v in kinds.items()))


if __name__ == "__main__":
    main()
