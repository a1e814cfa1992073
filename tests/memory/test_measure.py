"""`plan --memory --measure`: packtrain's own step under fake tensors, counted per phase; the estimate against it;
`--gpu-memory`; the run header's fit warning."""

import json
import random

import pytest
import torch
from cli_helpers import REPO, run_in_process
from tiny_models import FAMILY_CONFIGS

from packtrain.config import load_config
from packtrain.config.tiles import TILE_ROWS
from packtrain.memory import estimate as memory
from packtrain.memory.measure import GDN_NOTE, LiveBytes
from packtrain.models.text_config import config_dict_of, text_config
from packtrain.run.units import unit_shape

SEED_LORA = {"r": 8, "dropout": 0.05, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"]}


def pretokenized(path, prefix, continuations, vocab, item=(40, 70), target=(20, 40), seed=0):
    rng = random.Random(seed)
    p = [rng.randrange(vocab) for _ in range(prefix)]
    with path.open("w") as f:
        for i in range(continuations):
            f.write(json.dumps({"id": f"c{i}", "prefix_ids": p,
                                "item_ids": [rng.randrange(vocab) for _ in range(rng.randint(*item))],
                                "target_ids": [rng.randrange(vocab) for _ in range(rng.randint(*target))]}) + "\n")
    return path


def write_config(tmp_path, model: dict, train=None, lora=None, data=None, budget=100_000):
    import yaml

    data = data or pretokenized(tmp_path / "train.jsonl", 300, 6, 97)
    cfg = {"model": {"config": model, "dtype": "bfloat16"}, "data": {"train": str(data), "format": "pretokenized"},
           "lora": lora or SEED_LORA, "packing": {"token_budget": budget, "max_continuations": 500},
           "train": train or {"activation_checkpointing": True}}
    path = tmp_path / "cfg.yaml"
    path.write_text(f"# packtrain plan {path}\n" + yaml.safe_dump(cfg))
    return path


def measured_plan(*args) -> dict:
    return json.loads(run_in_process("plan", *args, "--memory", "--measure", "--json").stdout)["memory"]


def hybrid(hidden, intermediate, heads=4, gdn_heads=(2, 4), head_dim=32, vocab=97, layers=8):
    return {"model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": 2, "head_dim": head_dim, "linear_num_key_heads": gdn_heads[0],
            "linear_num_value_heads": gdn_heads[1], "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim}


# (widths, P, continuations, train.*): the pack grows in T and M, the widths in H and I; checkpointing, offload
# and neither (the savings not given are chosen for the 80 GiB `plan` assumes: whole, at these sizes)
SHAPES = {
    "checkpointed": (hybrid(512, 1536, heads=4, head_dim=64), 1500, 8, {"activation_checkpointing": True}),
    "wider, offloaded": (hybrid(256, 768, gdn_heads=(2, 6)), 2500, 12, {"offload": True}),
    "long P, wide MLP": (hybrid(192, 1024, heads=6), 5000, 6, {"activation_checkpointing": True}),
    "not checkpointed": (hybrid(256, 1024), 2000, 6, {"activation_checkpointing": False}),  # every layer's graph
    # every saving set: 3 of 8 layer inputs offloaded (the reduced model measures each kind offloaded and kept),
    # the loss in chunks, the MLP and the norms in tiles
    "every saving, partly offloaded": (hybrid(256, 768, gdn_heads=(2, 6)), 2500, 12,
                                       {"activation_checkpointing": True, "offload": 3, "loss_chunk_rows": 256,
                                        "mlp_chunk_rows": 512, "norm_chunk_rows": 512}),
    "tiles without checkpointing": (hybrid(256, 1024), 2000, 6,
                                    {"activation_checkpointing": False, "offload": False, "loss_chunk_rows": 64,
                                     "mlp_chunk_rows": 256, "norm_chunk_rows": 256}),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_estimate_is_within_10_percent_of_the_measured_step(tmp_path, shape):
    model, prefix, conts, train = SHAPES[shape]
    data = pretokenized(tmp_path / "train.jsonl", prefix, conts, model["vocab_size"], item=(400, 700),
                        target=(200, 400))
    assert_within_10_percent(measured_plan(write_config(tmp_path, model, train, data=data), "--world-size", "4"))


# hidden 64, float32: the demo trains lm_head and embed_tokens in full (modules_to_save), and runs without
# checkpointing (each layer's saved tensors counted once, in the graph or in its backward)
@pytest.mark.parametrize("name", ["demo", "vlm_demo"])
def test_the_estimate_is_within_10_percent_on_the_demo_configs(name):
    assert_within_10_percent(measured_plan(REPO / "configs" / f"{name}.yaml"))


def assert_within_10_percent(mem: dict) -> None:
    estimate, measured = mem["total_device_bytes"], mem["measured"]["peak_device_bytes"]
    assert abs(estimate - measured) <= 0.1 * measured, (mem["phases"], mem["measured"]["phases"])
    assert mem["measured"]["host_bytes"] == mem["total_host_bytes"]  # whole offload chunks, both ways
    assert estimate == max(mem["phases"].values())  # the largest phase, not a sum


SHIPPED = ["demo", "vlm_demo", "qwen3.6-27b", "qwen3.6-35b-a3b"]


@pytest.mark.parametrize("name", SHIPPED)
def test_measure_runs_on_every_shipped_config(tmp_path, name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    args = []
    if name.startswith("qwen3.6"):  # their data is the user's: a small pack of token ids
        args = ["--set", f"data.train={pretokenized(tmp_path / 'train.jsonl', 400, 4, 1000)}",
                "--set", "data.format=pretokenized", "--world-size", "64"]
    plan = measured_plan(REPO / "configs" / f"{name}.yaml", *args)
    mem = plan["measured"]
    assert mem["notes"][0] == GDN_NOTE
    if name == "vlm_demo":
        assert any("the vision tower is left out" in note for note in mem["notes"])
    kinds = {k for k, _ in text_config(config_dict_of(cfg))["kinds"]}
    chosen = plan["savings"]
    word = "recompute" if chosen["activation_checkpointing"] or chosen["offload_layers"] else "backward"
    assert {"forward", "loss", "optimizer"} <= set(mem["phases"])
    assert all(any(p.startswith(f"{word} {k}") for p in mem["phases"]) for k in kinds)
    assert mem["peak_device_bytes"] == max(mem["phases"].values()) > 0


def test_the_table_has_a_measured_column(tmp_path):
    out = run_in_process("plan", write_config(tmp_path, hybrid(64, 128)), "--memory", "--measure").stdout
    header = next(line for line in out.splitlines() if line.strip().startswith("phase"))
    assert header.split() == ["phase", "estimate", "measured"]
    assert f"measured: {GDN_NOTE}" in " ".join(out.split())  # a note past 120 columns wraps


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next", "qwen3"])
def test_measure_runs_on_each_family(tmp_path, family):
    layers = {"qwen3": ["full_attention"] * 2}.get(family, ["linear_attention", "full_attention"] * 2)
    model = {"model_type": family, "vocab_size": 97, "num_hidden_layers": len(layers), "layer_types": layers,
             **{k: v for k, v in FAMILY_CONFIGS[family].items() if k != "rope_parameters"}}
    if "moe_intermediate_size" in model:  # grouped_mm (CUDA's experts) wants 16-byte rows, as real widths are
        model.update(moe_intermediate_size=16, shared_expert_intermediate_size=32)
    mem = measured_plan(write_config(tmp_path, model))
    phases = mem["measured"]["phases"]
    if family == "qwen3_next":  # layer 0 dense, then routed experts every 2nd layer
        assert {"recompute linear_attention, dense", "recompute full_attention, moe"} <= set(phases)
    assert mem["measured"]["peak_device_bytes"] > 0


def test_a_lora_dropout_mask_counts_its_dtype():
    """packtrain's LoRA draws its dropout mask as ``empty_like(x).bernoulli_`` (packtrain/models/lora_compute.py), on
    CUDA as here: in the input's dtype, 2 bytes per element in bf16."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from packtrain.models import lora_compute

    with FakeTensorMode():
        x = torch.empty(1000, 1000, dtype=torch.bfloat16)
        counter = LiveBytes()
        with counter:
            mask = lora_compute._mask(x, 0.1)
        kept = counter.total
    assert mask.shape == x.shape and mask.dtype == torch.bfloat16
    assert kept == 1000 * 1000 * 2


def test_a_freed_storage_leaves_the_count_and_the_peak_stays():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        counter = LiveBytes()
        with counter:
            counter.set_phase("a")
            x = torch.empty(256, 1024)
            del x
            counter.set_phase("b")
            y = torch.empty(16)
    assert counter.peaks["a"] == 256 * 1024 * 4 and counter.peaks["b"] == 16 * 4
    assert counter.total == 16 * 4
    del y


def test_gpu_memory_gives_the_largest_budget_that_fits(tmp_path):
    """--gpu-memory GIB: the largest budget whose estimate, every saving left auto on, fits GIB less the reserve; a
    little more GPU memory holds a larger one."""
    from packtrain.memory import savings
    from packtrain.memory.budget import device_reserve, plan_budget

    model, prefix, conts, train = SHAPES["checkpointed"]
    path = write_config(tmp_path, model, train, data=pretokenized(tmp_path / "train.jsonl", prefix, conts, 97))
    out = json.loads(run_in_process("plan", path, "--memory", "--gpu-memory", "3", "--json").stdout)["memory"]
    budget = out["max_token_budget"]
    cfg = load_config(path)
    from packtrain.data.jsonl import load_split
    from packtrain.run.units import plan_for

    examples = load_split(cfg, "train")
    shape = unit_shape(cfg, plan_for(cfg, examples), examples)
    found = savings.max_token_budget(cfg, shape, 1, plan_budget(cfg, 1, 3.0), 3.0)
    assert found["token_budget"] == budget and found["estimate_bytes"] <= 3 * memory.GiB - found["reserve_bytes"]
    assert out["budget_search"]["reserve_bytes"] == device_reserve(3 * memory.GiB)
    assert out["budget_search"]["device_budget_bytes"] == out["device_budget_bytes"]
    larger = savings.max_token_budget(cfg, shape, 1, plan_budget(cfg, 1, 3.3), 3.3)
    assert larger["token_budget"] > budget
    text = run_in_process("plan", path, "--memory", "--gpu-memory", "3").stdout
    assert "largest packing.token_budget fitting 3 GiB per GPU less the" in text and f"{budget:,} positions" in text


def test_the_run_header_shows_the_choice(tmp_path):
    """The run header's memory lines: the chosen savings and their estimate, every candidate considered with the
    chosen one marked."""
    from types import SimpleNamespace

    from packtrain.data.jsonl import load_split
    from packtrain.memory import savings
    from packtrain.memory.budget import plan_budget
    from packtrain.run.header import memory_lines
    from packtrain.run.units import plan_for

    model = SHAPES["checkpointed"][0]
    cfg = load_config(write_config(tmp_path, model, {"offload": 2}))
    examples = load_split(cfg, "train")
    shape = unit_shape(cfg, plan_for(cfg, examples), examples)
    choice = savings.choose(cfg, shape, 1, plan_budget(cfg, 1, 80.0))
    lines = memory_lines(SimpleNamespace(savings=choice))
    assert lines[0].startswith("  memory: checkpointing, 2 of 8 layer inputs in host memory, ")
    assert "GiB per GPU at the largest unit" in lines[0]
    # at 80 GiB every candidate fits: one line says so, and what was given
    said = " ".join(" ".join(lines[1:]).split())
    assert said.startswith(f"memory savings by need: all {len(choice.candidates)} combinations fit") and \
        "given: train.offload 2" in said
    # at a budget some candidates do not fit: every candidate considered, the chosen one marked
    sizes = sorted(c.device_bytes for c in choice.candidates)
    low, high = 0.0, 80.0  # the GPU size whose budget (less its reserve) lies between the smallest and the largest
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if plan_budget(cfg, 1, mid).device_bytes < (sizes[0] + sizes[-1]) / 2 else (low, mid)
    choice = savings.choose(cfg, shape, 1, plan_budget(cfg, 1, high))
    assert choice.traded() and choice.chosen.fits
    lines = memory_lines(SimpleNamespace(savings=choice))
    rows = [line for line in lines if line[4:6] in ("->", "  ") and line[6:8] in ("on", "of")]
    marked = [line for line in rows if line[4:6] == "->"]
    assert len(marked) == 1 and "does not fit" not in marked[0]
    assert any("does not fit" in row for row in rows)
    assert "given: train.offload 2" in " ".join(" ".join(lines[1:3]).split())
    assert len(rows) == len(choice.candidates)


@pytest.mark.parametrize("loss_rows, mlp_rows", [(1024, None), (0, 0), (5, 7)])
def test_the_estimate_follows_the_configs_chunks(tmp_path, loss_rows, mlp_rows):
    from packtrain.data.jsonl import load_split
    from packtrain.run.units import plan_for

    model = hybrid(128, 384, vocab=1000)
    train = {"activation_checkpointing": True, "offload": False, "loss_chunk_rows": loss_rows,
             "mlp_chunk_rows": mlp_rows, "norm_chunk_rows": 0}
    cfg = load_config(write_config(tmp_path, model, train,
                                   data=pretokenized(tmp_path / "train.jsonl", 1500, 8, 1000, (400, 700), (200, 400))))
    examples = load_split(cfg, "train")
    shape = unit_shape(cfg, plan_for(cfg, examples), examples)
    estimate = memory.estimate_for_unit(cfg, shape, 1)
    M = sum(shape.targets)
    rows = min(loss_rows, M) if loss_rows else M
    assert estimate.get("logits").bytes == rows * 1000 * 3 * 4
    tile = TILE_ROWS["cuda"]["mlp"] if mlp_rows is None else mlp_rows
    assert ("tiled MLP" in estimate.get("mlp").label) == bool(tile)
    assert estimate.savings.loss_rows == loss_rows and estimate.savings.mlp_rows == tile


def test_the_estimates_tile_defaults_are_the_back_ends(tmp_path):
    """train.mlp_chunk_rows null: the estimate's MLP tile on each device is the one the back end takes there."""
    from packtrain.packed.kernels import select_backend

    train = {"activation_checkpointing": True, "offload": False, "loss_chunk_rows": 0, "mlp_chunk_rows": None,
             "norm_chunk_rows": 0}
    cfg = load_config(write_config(tmp_path, hybrid(128, 384, vocab=1000), train))
    for device in ("cpu", "cuda"):
        assert memory.savings_for(cfg, device).mlp_rows == select_backend("torch", device).mlp_rows


def test_the_seed_data_is_seeded_and_seed_shaped():
    import sys

    sys.path.insert(0, str(REPO / "tools" / "data"))
    from make_seed_data import seed_records

    first, again = list(seed_records(640, 8, 248_320, 0)), list(seed_records(640, 8, 248_320, 0))
    assert first == again and first != list(seed_records(640, 8, 248_320, 1))
    assert {len(r["prefix_ids"]) for r in first} == {640}
    assert all(400 <= len(r["item_ids"]) <= 700 and 200 <= len(r["target_ids"]) <= 400 for r in first)


def test_a_tiled_norms_backward_holds_what_the_estimate_counts():
    """A norm in 64-row tiles (packtrain/packed/recompute.py): its backward holds one tile's six float32 pieces beside
    the incoming gradient and its input's (filled tile by tile), and its saved bf16 input:
    memory.norm_terms' norm_input and norm_backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from packtrain.packed.recompute import tiled_norm

    T, H, rows = 300, 64, 64
    with FakeTensorMode():
        norm = Qwen3_5RMSNorm(H)
        norm.weight.data = norm.weight.data.to(torch.bfloat16)
        norm.weight.requires_grad_(False)
        x = torch.empty(T, H, dtype=torch.bfloat16, requires_grad=True)
        counter = LiveBytes()
        with counter:
            counter.tag(norm.weight, "weights")
            h = x * 2  # the norm's input, which it keeps
            y = tiled_norm(norm, rows, H, h)
            counter.set_phase("backward")
            y.backward(torch.ones_like(y))
    terms = {t.key: t.bytes for t in memory.norm_terms(text_config(hybrid(H, 128)), "full_attention", T, 2,
                                                       rows)}
    # the norm's output y beside it (what reads it holds it)
    assert counter.peaks["backward"] - T * H * 2 == terms["norm_input"] + terms["norm_backward"]
    assert terms["norm_input"] == T * H * 2


def test_a_tiled_mlps_backward_holds_what_the_estimate_counts():
    """A tile's backward (packtrain/packed/recompute.py): one tile's three saved [rows, I] and three SwiGLU gradients,
    the tile's output and the input's gradient, beside the MLP input that the tiles keep: memory.mlp_terms."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP

    from packtrain.packed.recompute import tiled_mlp

    model = hybrid(64, 160)
    T, rows = 300, 128
    with FakeTensorMode():
        mlp = Qwen3_5MLP(_hf_config(model), intermediate_size=160)
        for p in mlp.parameters():
            p.data = p.data.to(torch.bfloat16)
            p.requires_grad_(False)
        x = torch.empty(T, 64, dtype=torch.bfloat16, requires_grad=True)
        counter = LiveBytes()
        with counter:
            for p in mlp.parameters():
                counter.tag(p, "weights")
            y = tiled_mlp(mlp, mlp.forward, x, rows)
            counter.set_phase("backward")
            y.sum().backward()
    terms = {t.key: t.bytes for t in memory.mlp_terms(text_config(model), "full_attention", T, 2, mlp_rows=rows)}
    # x counts from the tiles' first view of it; the MLP's output y and the scalar loss are alive beside the tile
    assert counter.peaks["backward"] - T * 64 * 2 - 2 * 2 == terms["mlp"] + terms["mlp_tile"] + terms["workspace"]


def _hf_config(model: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(**model)


def test_the_loss_phase_is_extrapolated_to_every_layer():
    # the loss phase runs with every layer's checkpointed input alive: measured on one layer of each kind, it must
    # take the model's other layers' too (left as measured, no test saw it: the peak was elsewhere)
    from packtrain.memory.measure import LayerRecord, Measured, extrapolate

    text = text_config(hybrid(64, 128, layers=8))
    assert [k[0] for k in text["kinds"]] == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    gdn, attention = text["kinds"][0], text["kinds"][3]
    m = Measured(peaks={"forward": 300, "loss": 500, "optimizer": 0},
                 # no output bytes: what a layer keeps (kept) is its own (own)
                 layers=[LayerRecord(gdn, before=100, kept=10, own=10, peak=150),
                         LayerRecord(attention, before=110, kept=20, own=20, peak=170)],
                 weights=0, adapters=0, states=0, head_weights=0)
    whole = extrapolate(m, text, world=1)
    # measured with 10 + 20 bytes kept; the model keeps 6 x 10 + 2 x 20
    assert whole.phases["loss"] == 500 - (10 + 20) + (6 * 10 + 2 * 20)
    # the forward's peak: the last attention layer, after 6 GDN and 1 attention layers' kept bytes
    assert whole.phases["forward"] == 100 + (6 * 10 + 20) + (170 - 110)
