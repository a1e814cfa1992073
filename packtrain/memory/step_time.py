"""The estimated time of a training step under a combination of memory savings, from the model config: what the
choice of savings (:mod:`packtrain.memory.savings`) compares. The cost model's FLOPs (:mod:`packtrain.models.cost`:
6 per parameter a token meets, 12 per attention pair and width, 6 per head row and width x vocabulary), each
recompute one more forward of what it recomputes, at :data:`RATES`' FLOP rate; norms as elementwise work
(:data:`NORM_BYTES_PER_ELEMENT` at the memory rate); an offloaded input's copy to the host and back at the host rate,
each hidden behind the layer's own compute (the copy out beside its forward, the copy back beside the backward of the
layer after it: packtrain/models/offload.py prefetches it), only the rest added. The rates are assumptions about a
typical device, not measurements of this one."""

from __future__ import annotations

import math
from dataclasses import dataclass

from packtrain.memory.estimate import StepSavings, UnitShape
from packtrain.models.cost import CostModel, dense_mlp_forward_flops, layer_forward_flops
from packtrain.models.text_config import FULL
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
    """(the unit's attention pairs, P's own): the unit's own count (:func:`packtrain.run.units.unit_shape`), else a
    pack's (P, and every continuation against P and itself) or one sequence's."""
    from packtrain.data.attention_pairs import causal_pairs, pack_pairs

    p = shape.prefix
    if shape.attention_pairs is not None:
        return shape.attention_pairs, causal_pairs(p)
    if shape.shares_prefix:
        return pack_pairs(p, shape.lengths), causal_pairs(p)
    return causal_pairs(p + sum(shape.lengths)), causal_pairs(p)


def step_flops(text: dict, shape: UnitShape, savings: StepSavings, context_grad: str = "full") -> float:
    """The FLOPs of one forward and backward of the unit of ``shape`` with ``savings``: the cost model's
    (:mod:`packtrain.models.cost`) of its positions, attention pairs and target rows, and each recompute one more
    forward of what it recomputes. ``context_grad`` frozen runs P once without grad."""
    cost = CostModel.of_text(text)
    T, M = shape.prefix + sum(shape.lengths), sum(shape.targets)
    pairs, prefix_pairs = _pairs(shape)
    frozen = not context_mode(context_grad).prefix_in_graph and shape.shares_prefix  # P once, without its graph
    T_grad = T - shape.prefix if frozen else T
    pairs_grad = pairs - prefix_pairs if frozen else pairs
    flops = cost.flops(T_grad, pairs_grad, M)
    if frozen:  # P's no-grad pass
        flops += cost.forward_flops(shape.prefix, prefix_pairs)
    if savings.checkpointing:
        flops += cost.forward_flops(T_grad, pairs_grad)
    if savings.mlp_rows:
        flops += dense_mlp_forward_flops(text, T_grad)
    if savings.loss_rows:
        flops += cost.forward_flops(0, 0, M)
    return flops


def step_seconds(text: dict, shape: UnitShape, savings: StepSavings, dtype_bytes: int, device: str,
                 context_grad: str = "full") -> float:
    """The estimated seconds of one forward and backward of the unit of ``shape`` with ``savings`` (module docstring):
    what :func:`choose` compares."""
    rates = RATES[device]
    T = shape.prefix + sum(shape.lengths)
    frozen = not context_mode(context_grad).prefix_in_graph and shape.shares_prefix
    T_grad = T - shape.prefix if frozen else T
    seconds = step_flops(text, shape, savings, context_grad) / rates.flops
    if savings.norm_rows:
        seconds += _norm_elements_per_token(text) * T_grad * NORM_BYTES_PER_ELEMENT / rates.memory
    if savings.offload_layers and math.isfinite(rates.host):
        copy = T_grad * text["hidden_size"] * dtype_bytes / rates.host
        for forward in layer_forward_flops(text, T_grad)[:savings.offload_layers]:
            layer = forward / rates.flops  # the layer's forward (attention pairs left out: a floor)
            seconds += max(0.0, copy - layer) + max(0.0, copy - 2 * layer)
    return seconds
