"""`plan --memory` under packing.context_grad: each mode's estimate for Qwen3.6-27B at seed 000/003's pack (64K P +
80 x 1K), P's cache term against the tensors transformers' own cache holds, and the per-mode table."""

import argparse
import json

import pytest
import torch
from cli_helpers import write_config
from test_estimate import QWEN36_27B, SEED_LORA
from tiny_models import tiny_lora_model, tiny_text_config

import packtrain.packed.patch  # noqa: F401 - routes transformers' CPU kernels, as every packtrain process does
from packtrain.commands.plan import run_plan
from packtrain.memory import estimate as memory
from packtrain.models.text_config import text_config

GiB = 2**30
P, N, C = 65_536, 80, 1_024  # the seeds' pack: P of 64K tokens, 80 continuations of 1K
CHECKPOINTED = memory.StepSavings(activation_checkpointing=True)


def _seed_pack(mode):
    return memory.estimate(text_config(QWEN36_27B), P + N * C, N * 128, dtype="bfloat16", lora_r=8,
                           lora_targets=SEED_LORA, lora_dropout=0.05, context_grad=mode, prefix=P, continuations=N,
                           savings=CHECKPOINTED)


def test_each_mode_at_the_seed_pack():
    full, kv_only, frozen = (_seed_pack(m) for m in ("full", "kv_only", "frozen"))
    # full and kv_only checkpoint every layer's whole [P + 80K, 5120] bf16 input (kv_only recomputes P's rows to
    # build the K/V and GDN state the continuations read); frozen only the continuations'
    assert full.get("checkpointed_inputs").bytes == 64 * (P + N * C) * 5120 * 2
    assert kv_only.total() == full.total()
    assert frozen.get("checkpointed_inputs").bytes == 64 * N * C * 5120 * 2
    # P's cache: 16 attention layers x K and V [64K, 4 x 256] bf16 = 4 GiB, 48 GDN float32 states [48, 128, 128]
    # and conv tails [10240, 4] bf16
    cache = frozen.get("prefix_cache").bytes
    assert cache == 16 * 2 * P * 4 * 256 * 2 + 48 * (48 * 128 * 128 * 4 + 10240 * 4 * 2)
    assert cache / GiB == pytest.approx(4.14, abs=0.01)
    # what frozen saves: P's share of the checkpointed inputs (40 GiB) and of the recomputed layer, whose activations
    # are linear in the rows the layer spans: full's (P + N x C rows) over frozen's (N x C) is their ratio. Both hold
    # the weights, their gradients and the optimizer's states besides (the optimizer phase, the same in both).
    phase = "recompute full_attention"
    assert full.peak_phase == frozen.peak_phase == phase
    held = full.phases["optimizer"]
    full_layer = full.phases[phase] - full.get("checkpointed_inputs").bytes - held
    frozen_layer = frozen.phases[phase] - frozen.get("checkpointed_inputs").bytes - cache - held
    assert full_layer / frozen_layer == pytest.approx((P + N * C) / (N * C), rel=0.01)
    assert (full.total() - frozen.total()) / GiB > 40 - 4.14


def test_prefix_cache_term_equals_transformers_cache():
    """The cache term counts exactly the tensors transformers' cache holds after P (K/V of every attention layer,
    every GDN layer's recurrent and conv state)."""
    layer_types = ["linear_attention", "full_attention", "linear_attention"]
    model = tiny_lora_model(layer_types, dtype=torch.float32)
    p = 37
    with torch.no_grad():
        cache = model(input_ids=torch.arange(p)[None] % 97, use_cache=True).cache
    held = 0
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            held += layer.recurrent_states[0].numel() * 4 + layer.conv_states[0].numel() * 4
        else:
            held += (layer.keys.numel() + layer.values.numel()) * 4
    text = text_config(tiny_text_config(layer_types).to_dict())
    (term, _) = memory.frozen_prefix_terms(text, p, 4)
    assert term.bytes == held


def test_plan_memory_prints_every_mode(tmp_path, capsys):
    cfg = write_config(tmp_path, model={"dtype": "bfloat16"}, train={"activation_checkpointing": True},
                       packing={"context_grad": "frozen"})
    run_plan(argparse.Namespace(config=str(cfg), overrides=[], world_size=1, memory=True, json=False,
                                measure=False, gpu_memory=None, ranks_per_node=None,
                                host_memory_per_node=None))
    out = capsys.readouterr().out
    assert "context_grad frozen" in out and "P's cache:" in out  # the configured mode's terms
    assert [line.split()[0] for line in out.splitlines()[-3:]] == ["full", "kv_only", "frozen"]
    run_plan(argparse.Namespace(config=str(cfg), overrides=[], world_size=1, memory=True, json=True,
                                measure=False, gpu_memory=None, ranks_per_node=None,
                                host_memory_per_node=None))
    modes = json.loads(capsys.readouterr().out)["memory"]["context_grad"]
    totals = {m: v["total_device_bytes"] for m, v in modes.items()}
    assert totals["kv_only"] == totals["full"] > totals["frozen"] > 0


def test_plan_memory_under_tree_has_no_table_of_modes_it_does_not_build(tmp_path, capsys):
    """packing.mode tree builds context_grad full only (the config refuses kv_only and frozen): `plan --memory`
    estimates it, and neither the table nor the JSON offers the other modes."""
    cfg = write_config(tmp_path, packing={"mode": "tree"})
    for as_json in (False, True):
        run_plan(argparse.Namespace(config=str(cfg), overrides=[], world_size=1, memory=True, json=as_json,
                                    measure=False, gpu_memory=None, ranks_per_node=None,
                                    host_memory_per_node=None))
        out = capsys.readouterr().out
        if as_json:
            assert "context_grad" not in json.loads(out)["memory"] and json.loads(out)["memory"]["terms"]
        else:
            assert "total on the device" in out and "each packing.context_grad" not in out and "kv_only" not in out


def test_continuation_groups_at_the_seed_pack():
    """packing.continuation_groups: 8 groups of 10 x 1K hold P's and one group's checkpointed inputs, the larger
    recompute (P's), and the gradients of P's outputs (the size of frozen's cache)."""
    full, frozen = _seed_pack("full"), _seed_pack("frozen")
    group = 10 * C
    grouped = memory.estimate(text_config(QWEN36_27B), P + N * C, N * 128, dtype="bfloat16", lora_r=8,
                              lora_targets=SEED_LORA, lora_dropout=0.05, prefix=P, continuations=N,
                              group_positions=group, savings=CHECKPOINTED)
    assert grouped.get("checkpointed_inputs").bytes == 64 * (P + group) * 5120 * 2
    assert grouped.get("prefix_grads").bytes == frozen.get("prefix_cache").bytes
    recompute_P = memory.estimate(text_config(QWEN36_27B), P, 0, dtype="bfloat16", lora_r=8,
                                  lora_targets=SEED_LORA, lora_dropout=0.05,
                                  savings=CHECKPOINTED).get("layer_peak").bytes
    assert grouped.get("layer_peak").bytes == recompute_P
    assert grouped.total() < 0.7 * full.total()
