"""Memory estimator: the seed's figures for Qwen3.6-27B and the MLP / adapter terms against the tensors autograd
actually saves. Parameter counts against transformers and peft: tests/models/test_parameters.py."""

import json

import pytest
import torch
from cli_helpers import REPO, TINY_MODEL, run_in_process, write_config

from packtrain.config import config_from_dict, load_config
from packtrain.memory import estimate as memory
from packtrain.models.text_config import config_dict_of, text_config

GiB = 2**30
# Qwen3.6-27B's text config (docs/FACTS: hidden 5120, 64 layers [linear x3, full] x 16, 24 heads, 4 KV heads,
# head_dim 256, intermediate 17408, vocab 248320, linear key heads 16, value heads 48, head dims 128, conv 4).
QWEN36_27B = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 64, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 24,
    "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
QWEN36_27B["layer_types"] = QWEN36_27B["layer_types"] * 16
SEED_LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"]


def _seed_estimate(positions, targets=1000, offload=0, **kw):
    args = {"dtype": "bfloat16", "lora_r": 8, "lora_targets": SEED_LORA, "lora_dropout": 0.05,
            "savings": memory.StepSavings(activation_checkpointing=True, offload_layers=offload), **kw}
    return memory.estimate(text_config(QWEN36_27B), positions, targets, **args)


def test_seed_hidden_state_and_checkpointed_inputs():
    est = _seed_estimate(70_000)
    inputs = est.get("checkpointed_inputs").bytes
    assert inputs / 64 / GiB == pytest.approx(0.67, abs=0.005)  # one [70K, 5120] bf16 hidden state
    assert inputs / GiB == pytest.approx(43, abs=0.5)  # 64 checkpointed layer inputs
    assert est.get("checkpointed_inputs").where == "device"


def test_seed_mlp_intermediate():
    assert _seed_estimate(70_000).get("mlp").bytes / 3 / GiB == pytest.approx(2.3, abs=0.05)


def test_seed_full_logits_for_144k_positions():
    full = _seed_estimate(144_000).get("logits_full")
    assert full.bytes / 1e9 == pytest.approx(71.5, abs=0.05) and full.where == "compare"


def test_seed_down_proj_adapter_costs_3_4_gib_per_recomputed_layer():
    # The seed's adapters were bf16: a [70K, 17408] dropout copy (2.3 GiB) and its 1-byte mask (1.1 GiB).
    with_down = _seed_estimate(70_000, lora_targets=SEED_LORA + ["down_proj"], adapter_dtype="bfloat16")
    without = _seed_estimate(70_000, adapter_dtype="bfloat16")
    saved = with_down.get("layer_peak").bytes - without.get("layer_peak").bytes
    assert saved / GiB == pytest.approx(3.4, abs=0.05)


def test_shipped_27b_config_is_the_seed_setup():
    path = REPO / "configs" / "qwen3.6-27b.yaml"
    first = path.read_text().splitlines()[0]
    assert first.startswith("# accelerate launch --config_file launch/eight_nodes_64gpu.yaml")
    assert first.endswith(" -m packtrain train configs/qwen3.6-27b.yaml")
    cfg = load_config(path)
    assert cfg.model.config == QWEN36_27B
    assert (cfg.model.dtype, cfg.packing.token_budget, cfg.packing.max_continuations) == ("bfloat16", 150000, 90)
    assert (cfg.lora.r, cfg.lora.dropout, cfg.lora.target_modules) == (8, 0.05, SEED_LORA)
    # every memory saving left to the choice by need (tests/memory/test_savings.py: what it takes at 80 GiB)
    assert all(getattr(cfg.train, key) == "auto" for key in ("activation_checkpointing", "offload",
                                                            "loss_chunk_rows", "mlp_chunk_rows", "norm_chunk_rows"))


def test_offload_chunk_matches_the_offload_module():
    offload = pytest.importorskip("packtrain.models.offload")
    assert memory.OFFLOAD_CHUNK_BYTES == offload.DEFAULT_CHUNK_BYTES


def test_the_delta_rule_calls_rows_match_the_fla_back_end():
    fla_backend = pytest.importorskip("packtrain.packed.kernels.fla_backend")
    assert memory.GDN_CALL_ROWS == fla_backend.CALL_ROWS


def _saved_bytes_of_mlp(dtype, targets, dropout, T):
    """Bytes of the activations autograd saves in one MLP forward (parameters excluded, each storage once)."""
    from packtrain.models.build import apply_lora, build_base_model

    cfg = config_from_dict({"model": {"config": TINY_MODEL, "dtype": dtype},
                            "lora": {"r": 4, "dropout": dropout, "target_modules": targets}})
    model = apply_lora(build_base_model(cfg), cfg).train()
    mlp = model.get_base_model().model.layers[0].mlp
    params = {p.data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.data_ptr() not in params:
            saved[t.data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(T, TINY_MODEL["hidden_size"], dtype=getattr(torch, dtype), requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("targets", [["gate_proj"], ["gate_proj", "up_proj", "down_proj"], ["q_proj"]])
def test_mlp_and_adapter_terms_equal_what_autograd_saves(dtype, dropout, targets):
    T = 37
    measured = _saved_bytes_of_mlp(dtype, targets, dropout, T)
    b = memory.DTYPE_BYTES[dtype]
    # packtrain's adapters compute in the model's dtype (float32 master weights, cast for the compute) and draw
    # their dropout masks again in backward (packtrain/models/lora_compute.py)
    savings = memory.StepSavings(lora_in_model_dtype=True, masks_regenerated=True)
    terms = memory.layer_recompute(text_config(TINY_MODEL), "linear_attention", T, b, b, 4, targets,
                                   dropout, savings=savings)
    mlp_terms = [t for t in terms if t.key == "mlp" or t.key in {f"lora:{n}" for n in ("gate_proj", "up_proj",
                                                                                         "down_proj")}]
    assert sum(t.bytes for t in mlp_terms) == measured


@pytest.mark.parametrize("offloaded", [64, 40, 1])
def test_offload_moves_layer_inputs_to_host_in_chunks(offloaded):
    """The first N layers' inputs in host memory, in whole 64 MiB chunks; the others on the device. Each offloaded
    layer below the first takes one input off the device: the first's stays (the embedding's output)."""
    est, kept = _seed_estimate(70_000, offload=offloaded), _seed_estimate(70_000)
    per_layer = 70_000 * 5120 * 2
    host = est.get("offloaded_inputs")
    assert host.where == "host" and host.bytes == offloaded * (-(-per_layer // (64 * 2**20)) * 64 * 2**20)
    if offloaded < 64:
        assert est.get("checkpointed_inputs").bytes == (64 - offloaded) * per_layer
    assert est.phases["loss"] == kept.phases["loss"] - (offloaded - 1) * per_layer
    # in backward, an offloaded layer holds its input fetched back and the one before it being prefetched
    assert est.get("fetched").bytes == 2 * per_layer


def test_world_size_shards_the_weights_and_adds_gathered_layers():
    one, many = _seed_estimate(70_000), _seed_estimate(70_000, world_size=64)
    assert many.get("weights").bytes * 64 == pytest.approx(one.get("weights").bytes, abs=64)
    assert many.get("gathered").approx


def test_plan_memory_prints_the_estimate(tmp_path):
    cfg = write_config(tmp_path, model={"dtype": "bfloat16"},
                       train={"activation_checkpointing": True, "mlp_chunk_rows": None})
    out = run_in_process("plan", cfg, "--memory", "--world-size", "2").stdout
    assert "memory per GPU for the largest pack:" in out and "world size 2" in out
    assert "tiled MLP: its input [" in out and "total on the device" in out  # train.mlp_chunk_rows null: tiles
    stats = json.loads(run_in_process("plan", cfg, "--memory", "--json").stdout)
    terms = {t["key"]: t for t in stats["memory"]["terms"]}
    assert terms["checkpointed_inputs"]["bytes"] == 3 * terms["residual"]["bytes"]  # 3 layers x [T, H]
    # the peak is the largest phase: the loss's and a layer recompute's transients are never alive together
    everything = sum(t["bytes"] for t in terms.values() if t["where"] == "device" and t["depth"] == 0)
    phases = stats["memory"]["phases"]
    assert stats["memory"]["total_device_bytes"] == max(phases.values()) < everything
    assert all(terms["layer_peak"]["bytes"] <= phases[p] for p in phases if p.startswith("recompute"))


def test_plan_memory_rejects_a_bad_world_size(tmp_path):
    proc = run_in_process("plan", write_config(tmp_path), "--memory", "--world-size", "0", check=False)
    assert proc.returncode == 2 and "--world-size" in proc.stderr


def test_model_path_config_json_is_read(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": QWEN36_27B}))
    cfg = config_from_dict({"model": {"path": str(tmp_path / "m")}})
    assert text_config(config_dict_of(cfg))["hidden_size"] == 5120


# -- other families (packtrain.packed.families) -----------------------------------------------------------------------------

def test_shipped_35b_a3b_config_adapts_the_experts():
    path = REPO / "configs" / "qwen3.6-35b-a3b.yaml"
    assert path.read_text().splitlines()[0] == ("# accelerate launch --config_file launch/one_node_8gpu.yaml -m packtrain "
                                                "train configs/qwen3.6-35b-a3b.yaml")
    cfg = load_config(path)
    assert cfg.model.config["model_type"] == "qwen3_5_moe_text" and cfg.lora.dropout == 0
    assert cfg.lora.target_parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
