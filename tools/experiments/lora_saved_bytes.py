"""What the LoRA adapters of one Qwen3.6-27B attention layer keep for backward, peft's ``lora.Linear.forward``
against packtrain's (:mod:`packtrain.models.lora_compute`), on the meta device (the true widths, no memory).

Per adapter: the bytes autograd saves in its call (each storage once, parameters left out: q, k and v read one input,
which counts for the first of them), and the largest tensor the call makes (packtrain's: the base layer's output). bf16 model, float32 adapters built
by packtrain's ``apply_lora``; dropout masks at CPU size (the input's dtype; CUDA's fused dropout keeps 1 byte).

    python tools/experiments/lora_saved_bytes.py [--tokens 133189] [--r 8] [--dropout 0.05]
"""

from __future__ import annotations

import argparse

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch.utils._python_dispatch import TorchDispatchMode

from packtrain.config import config_from_dict
from packtrain.models.build import apply_lora, model_class_for
from packtrain.models.lora_compute import lora_forward

WIDTHS = {"model_type": "qwen3_5_text", "vocab_size": 1024, "hidden_size": 5120, "intermediate_size": 17408,
          "num_hidden_layers": 1, "layer_types": ["full_attention"], "num_attention_heads": 24,
          "num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": False}
ADAPTERS = [("q_proj", "x"), ("k_proj", "x"), ("v_proj", "x"), ("o_proj", "attention output"),
            ("gate_proj", "MLP input")]
GiB = 2**30


class Largest(TorchDispatchMode):
    """The largest tensor any op returns in a storage of its own (not a view of an input) while active."""

    def __init__(self):
        super().__init__()
        self.bytes, self.what = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage()._cdata for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs and t.nbytes > self.bytes:
                self.bytes, self.what = t.nbytes, f"{str(t.dtype)[6:]} {list(t.shape)}"
        return out


def adapters(tokens: int, r: int, dropout: float) -> dict:
    from transformers import AutoConfig

    raw = dict(WIDTHS)
    cfg = config_from_dict({"model": {"config": raw, "dtype": "bfloat16"},
                            "lora": {"r": r, "dropout": dropout, "target_modules": [n for n, _ in ADAPTERS]}})
    hf_config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        base = model_class_for("qwen3_5_text")(hf_config).to(torch.bfloat16)
    model = apply_lora(base, cfg).train().to("meta")
    layer = model.get_base_model().model.layers[0]
    modules = {"q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj, "v_proj": layer.self_attn.v_proj,
               "o_proj": layer.self_attn.o_proj, "gate_proj": layer.mlp.gate_proj}
    inputs = {}
    for name, source in ADAPTERS:
        width = modules[name].in_features
        inputs.setdefault(source, torch.empty(1, tokens, width, dtype=torch.bfloat16, device="meta",
                                              requires_grad=True))
    return {name: (modules[name], inputs[source]) for name, source in ADAPTERS}


def measure(layers: dict, forward) -> dict:
    params = {p.untyped_storage()._cdata for m, _ in layers.values() for p in m.parameters()}
    seen: set = set()
    rows, outputs = {}, []  # the outputs hold their graphs, so no saved storage is freed and its address reused
    for name, (module, x) in layers.items():
        saved = {}

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in params and key not in seen:
                saved[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Largest() as largest:
            outputs.append(forward(module, x))
        seen |= saved.keys()
        rows[name] = (sum(saved.values()), largest.what)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=133_189, help="positions of the pack (the seed pack's)")
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--dropout", type=float, default=0.05)
    args = ap.parse_args()
    layers = adapters(args.tokens, args.r, args.dropout)
    peft, ours = measure(layers, PeftLoraLinear.forward), measure(layers, lora_forward)
    print(f"T = {args.tokens:,}, r = {args.r}, dropout {args.dropout}: saved for backward (GiB), largest tensor made")
    print(f"| adapter | peft saves | packtrain saves | peft's largest | packtrain's largest |\n|---|---|---|---|---|")
    for name in layers:
        (pb, pw), (ob, ow) = peft[name], ours[name]
        print(f"| {name} | {pb / GiB:.2f} | {ob / GiB:.3f} | {pw} | {ow} |")
    total = [sum(b for b, _ in rows.values()) / GiB for rows in (peft, ours)]
    print(f"| all five | {total[0]:.2f} | {total[1]:.3f} | | |")


if __name__ == "__main__":
    main()
