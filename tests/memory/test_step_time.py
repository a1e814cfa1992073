"""The estimated step time (packtrain/memory/step_time.py) against FLOPs counted by hand on a toy model."""

import dataclasses

import pytest
from cli_helpers import REPO, seed_unit_shape

from packtrain.config import load_config
from packtrain.memory.estimate import StepSavings, UnitShape
from packtrain.memory.step_time import NORM_BYTES_PER_ELEMENT, RATES, step_seconds
from packtrain.models.text_config import text_config

SEED_CONFIG = REPO / "configs" / "qwen3.6-27b.yaml"
TOY = {"model_type": "qwen3_5_text", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
       "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 2,
       "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
       "linear_key_head_dim": 16, "linear_value_head_dim": 16}
# per token, counted by hand: GDN qkv (2 x 32 + 32), z (32), b and a (2 each), out (32 x 64); attention q with its
# output gate (2 x 2 x 32), k, v (32 each), o (64 x 64); every MLP gate, up, down
GDN_PARAMS = 64 * (96 + 32 + 2 + 2) + 32 * 64
ATTENTION_PARAMS = 64 * (128 + 32 + 32) + 64 * 64
MLP_PARAMS = 3 * 64 * 128
TOY_SHAPE = UnitShape(100, [20, 30], [10, 15])
TOY_T, TOY_M = 150, 25
TOY_PAIRS = 100 * 101 // 2 + (20 * 100 + 20 * 21 // 2) + (30 * 100 + 30 * 31 // 2)


def _toy_seconds(**s) -> float:
    return step_seconds(text_config(TOY), TOY_SHAPE, StepSavings(**s), 2, "cuda")


def test_the_step_cost_counts_each_recompute_as_one_more_forward():
    """The toy counted by hand: per token a forward meets 2 FLOPs per parameter, a pair of attention 4 per width; the
    step is three forwards (the cost model's 6 and 12), and each saving adds a forward of what it recomputes."""
    forward = 2 * (GDN_PARAMS + ATTENTION_PARAMS + 2 * MLP_PARAMS) * TOY_T + 4 * 64 * TOY_PAIRS
    head = 2 * 64 * 1000 * TOY_M
    step = 3 * (forward + head)
    none = _toy_seconds()
    assert none == pytest.approx(step / RATES["cuda"].flops, rel=1e-12)
    assert _toy_seconds(activation_checkpointing=True) / none == pytest.approx((step + forward) / step, rel=1e-12)
    assert _toy_seconds(mlp_rows=64) / none == pytest.approx((step + 2 * 2 * MLP_PARAMS * TOY_T) / step, rel=1e-12)
    assert _toy_seconds(loss_rows=8) / none == pytest.approx((step + head) / step, rel=1e-12)
    # every norm's elements per token: 2 per layer over 64, q/k norms (2 + 1 heads of 32), the gated norm (32), the
    # final norm (64)
    norms = TOY_T * (4 * 64 + 3 * 32 + 32 + 64) * NORM_BYTES_PER_ELEMENT / RATES["cuda"].memory
    assert _toy_seconds(norm_rows=8) - none == pytest.approx(norms, rel=1e-12)


def test_an_offloaded_input_costs_only_what_its_layers_compute_does_not_hide():
    """The copy out beside the layer's forward, the copy back beside the backward of the layer after it (two
    forwards' time): the toy's narrow layers compute faster than their input copies, and expose the difference; at
    the seed's widths the copies hide behind the compute."""
    rates = RATES["cuda"]
    copy = TOY_T * 64 * 2 / rates.host
    layer = 2 * (GDN_PARAMS + MLP_PARAMS) * TOY_T / rates.flops  # layer 0, the one offloaded
    assert copy > 2 * layer
    exposed = _toy_seconds(activation_checkpointing=True, offload_layers=1) - _toy_seconds(activation_checkpointing=True)
    assert exposed == pytest.approx((copy - layer) + (copy - 2 * layer), rel=1e-9)
    text = text_config(load_config(SEED_CONFIG).model.config)
    kept, seed = StepSavings(activation_checkpointing=True), seed_unit_shape()
    offloaded = dataclasses.replace(kept, offload_layers=64)
    assert step_seconds(text, seed, offloaded, 2, "cuda") == step_seconds(text, seed, kept, 2, "cuda")
