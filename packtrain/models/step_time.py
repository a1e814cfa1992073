"""The estimated time of a training step under a combination of memory savings, from the model config: what the
choice of savings (:mod:`packtrain.models.savings`) compares. The cost model's FLOPs (6 per parameter a token meets
and 12 per attention pair and width: forward 2 and 4, backward twice that; the head on the target rows the same),
each recompute one more forward of what it recomputes, at :data:`RATES`' FLOP rate; norms as elementwise work
(:data:`NORM_BYTES_PER_ELEMENT` at the memory rate); an offloaded input's copy to the host and back at the host rate,
each hidden behind the layer's own compute (the copy out beside its forward, the copy back beside the backward of the
layer after it: packtrain/models/offload.py prefetches it), only the rest added. The rates are assumptions about a
typical device, not measurements of this one."""

from __future__ import annotations

import math
from dataclasses import dataclass

from packtrain.models.memory import StepSavings, UnitShape
from packtrain.models.parameters import expert_shapes, linears
from packtrain.models.text_config import DENSE, FULL
from packtrain.packed.context import context_grad as context_mode


@dataclass(frozen=True)
class Rates:
    flops: float  # matmul FLOP/s the step reaches
    memory: float  # bytes/s of elementwise work
    host: float  # bytes/s between host and device, each direction (offload)


# Assumed figures for the step-time model: an H100-class GPU at about 40% of its bf16 peak, ~2/3 of its memory
# bandwidth for elementwise kernels, pinned PCIe copies at 25 GB/s each way; a CPU core's few tens of GFLOP/s
# against its memory (no host copies: the host is the device).
RATES = {"cuda": Rates(flops=400e12, memory=2.0e12, host=25e9), "cpu": Rates(flops=5e10, memory=1e10, host=math.inf)}
# A norm's recompute in the step's elementwise work: its input read, float32 pieces written and read
NORM_BYTES_PER_ELEMENT = 24


# -- the model's work, per token ---------------------------------------------------------------------------------------
def layer_parameters_per_token(text: dict, kind) -> tuple[int, int]:
    """(mixer, MLP): the linear parameters one token meets in a decoder layer of ``kind`` (a MoE layer: its router,
    shared expert and ``num_experts_per_tok`` routed experts)."""
    mixer = mlp = 0
    for i, o, group in linears(text, kind).values():
        if group in ("post_norm", "mlp_product"):
            mlp += i * o
        else:
            mixer += i * o
    experts = expert_shapes(text, kind)
    if experts:  # a token meets num_experts_per_tok of them
        mlp += text["num_experts_per_tok"] * sum(i * o for _, i, o in experts.values())
    return mixer, mlp


def parameters_per_token(text: dict) -> int:
    """The linear parameters one token meets in the decoder stack (the cost model's per-position count)."""
    return sum(sum(layer_parameters_per_token(text, k)) for k in text["kinds"])


def attention_width(text: dict) -> int:
    """heads x head_dim summed over the full-attention layers: what one query-key pair costs per multiply-add."""
    return sum(text["num_attention_heads"] * text["head_dim"] for k in text["kinds"] if k[0] == FULL)


def _norm_elements_per_token(text: dict) -> int:
    """Elements every RMSNorm of the stack sees per token: two per layer over the hidden state, the q/k norms or the
    gated norm, the final norm."""
    H, n = text["hidden_size"], text["hidden_size"]
    for mixer, _ in text["kinds"]:
        n += 2 * H
        if mixer == FULL:
            n += (text["num_attention_heads"] + text["num_key_value_heads"]) * text["head_dim"]
        else:
            n += text["linear_num_value_heads"] * text["linear_value_head_dim"]
    return n


def _pairs(shape: UnitShape) -> tuple[int, int]:
    """(the unit's attention pairs, P's own): a pack's (P, and every continuation against P and itself), or one
    sequence's."""
    from packtrain.data.pairs import causal_pairs, pack_pairs

    p = shape.prefix
    if shape.shares_prefix:
        return pack_pairs(p, shape.lengths), causal_pairs(p)
    return causal_pairs(p + sum(shape.lengths)), causal_pairs(p)


def step_seconds(text: dict, shape: UnitShape, savings: StepSavings, dtype_bytes: int, device: str,
                 context_grad: str = "full") -> float:
    """The estimated seconds of one forward and backward of the unit of ``shape`` with ``savings`` (module docstring):
    what :func:`choose` compares. ``context_grad`` frozen runs P once without grad."""
    rates = RATES[device]
    T, M, H = shape.prefix + sum(shape.lengths), sum(shape.targets), text["hidden_size"]
    pairs, prefix_pairs = _pairs(shape)
    width = attention_width(text)
    frozen = not context_mode(context_grad).prefix_grad and shape.shares_prefix  # P once, without its graph
    T_grad = T - shape.prefix if frozen else T
    pairs_grad = pairs - prefix_pairs if frozen else pairs
    per_layer = [layer_parameters_per_token(text, k) for k in text["kinds"]]
    forward = 2 * sum(m + f for m, f in per_layer) * T_grad + 4 * width * pairs_grad  # one forward of the layers
    head = 2 * H * text["vocab_size"] * M
    flops = 3 * (forward + head)
    if frozen:  # P's no-grad pass
        flops += 2 * sum(m + f for m, f in per_layer) * shape.prefix + 4 * width * prefix_pairs
    if savings.checkpointing:
        flops += forward
    if savings.mlp_rows:
        dense = sum(f for (m, f), k in zip(per_layer, text["kinds"]) if k[1] == DENSE)
        flops += 2 * dense * T_grad
    if savings.loss_rows:
        flops += head
    seconds = flops / rates.flops
    if savings.norm_rows:
        seconds += _norm_elements_per_token(text) * T_grad * NORM_BYTES_PER_ELEMENT / rates.memory
    if savings.offload_layers and math.isfinite(rates.host):
        copy = T_grad * H * dtype_bytes / rates.host
        for m, f in per_layer[:savings.offload_layers]:
            layer = (2 * (m + f) * T_grad) / rates.flops  # the layer's forward (attention pairs left out: a floor)
            seconds += max(0.0, copy - layer) + max(0.0, copy - 2 * layer)
    return seconds
