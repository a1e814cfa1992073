"""The memory savings chosen by need (packtrain/memory/savings.py): tables of which savings the choice takes for given shapes and budgets (device, host, CPU), each checked
against the memory estimate itself: the choice fits, takes the fewest layer inputs to the host that fit, and no
faster combination fits."""

import dataclasses
import json
import sys

import re

import pytest
from cli_helpers import REPO, run_in_process, seed_unit_shape, write_config

from packtrain.config import load_config
from packtrain.memory import estimate as memory
from packtrain.memory import savings
from packtrain.memory.budget import Budget, device_reserve, plan_budget
from packtrain.memory.estimate import GiB, StepSavings, UnitShape

SEED_CONFIG = REPO / "configs" / "qwen3.6-27b.yaml"
AUTO = {k: "auto" for k in savings.KEYS}


SEED = seed_unit_shape()


def _config(**train):
    cfg = load_config(SEED_CONFIG)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{**AUTO, **train}))


def _choose(gpu_gib: float, host_gib: float | None = None, ranks: int = 8, world: int = 64, **train):
    cfg = _config(**train)
    return savings.choose(cfg, SEED, world, plan_budget(cfg, world, gpu_gib, ranks, host_gib)), cfg


def _fits(cfg, s: StepSavings, budget) -> bool:
    """Whether ``s`` fits, from the memory estimate and the host pools counted here by hand."""
    est = memory.estimate_for_unit(cfg, SEED, 64, savings=s)
    per_layer = (SEED.prefix + sum(SEED.lengths)) * 5120 * 2  # [T, 5120] bf16
    chunks = -(-per_layer // 2**26) * 2**26
    host_ok = budget.host_per_node is None or budget.ranks_per_node * s.offload_layers * chunks <= budget.host_per_node
    return est.total() <= budget.device_bytes and host_ok


# -- which savings the choice takes ----------------------------------------------------------------------------------
# (GPU GiB, host GiB per node (None: not limited), ranks per node) -> (checkpointing, layer inputs to the host, loss
# rows, MLP rows, norm rows) at the seed-like pack, world size 64
SEED_TABLE = [
    (80, None, 8, (True, 48, 256, 0, 0)),  # the MLP whole, 16 layer inputs on the device
    (80, 256, 8, (True, 24, 256, 8192, 8192)),  # 32 GiB per rank holds 24 inputs: the rest fit by tiles
    (40, None, 8, (True, 55, 256, 8192, 8192)),  # every saving on
    (141, None, 8, (True, 0, 256, 0, 0)),  # an H200: every layer input on the device
]


@pytest.mark.parametrize("gpu,host,ranks,expected", SEED_TABLE, ids=[f"{g}GiB-host{h}" for g, h, _, _ in SEED_TABLE])
def test_the_choice_at_the_seed_pack(gpu, host, ranks, expected):
    choice, cfg = _choose(gpu, host, ranks)
    s = choice.chosen.savings
    assert (s.checkpointing, s.offload_layers, s.loss_rows, s.mlp_rows, s.norm_rows) == expected
    budget = choice.budget
    assert budget.device_bytes == gpu * GiB - device_reserve(gpu * GiB) <= (gpu - 4) * GiB
    assert _fits(cfg, s, budget) and choice.warning() is None
    if s.offload_layers:  # the fewest inputs to the host that fit
        assert not _fits(cfg, dataclasses.replace(s, offload_layers=s.offload_layers - 1), budget)
    fastest = min(c.relative_cost for c in choice.candidates if c.fits)
    assert choice.chosen.relative_cost <= fastest + savings.AS_FAST


def test_less_memory_costs_more_time_and_a_host_limit_keeps_layers_on_the_device():
    chosen = {gpu: _choose(gpu)[0].chosen for gpu in (40, 80, 141)}
    assert chosen[40].relative_cost > chosen[80].relative_cost >= chosen[141].relative_cost
    assert chosen[80].savings.offload_layers > chosen[141].savings.offload_layers
    limited = _choose(80, host_gib=256)[0].chosen.savings
    per_rank = 256 * GiB // 8
    layer = 21 * 2**26  # [131,233, 5,120] bf16 in 64 MiB chunks
    assert limited.offload_layers == per_rank // layer == 24


def test_given_values_are_kept():
    choice, _ = _choose(40, mlp_chunk_rows=0, offload=10)
    s = choice.chosen.savings
    assert (s.mlp_rows, s.offload_layers) == (0, 10)
    assert choice.given == {"mlp_chunk_rows": 0, "offload": 10}
    assert {c.savings.mlp_rows for c in choice.candidates} == {0}


def test_nothing_that_fits_is_said_with_the_figures():
    choice, _ = _choose(8)
    assert not choice.chosen.fits
    s = choice.chosen.savings  # the most saving: every tile, every input offloaded
    assert (s.offload_layers, s.loss_rows, s.mlp_rows, s.norm_rows) == (64, 256, 8192, 8192)
    warning = choice.warning()
    assert warning.startswith("warning: no combination of the savings fits the largest unit: the estimate's peak")
    assert f"{choice.chosen.device_bytes / GiB:.2f} GiB" in warning and f"{choice.budget.device_bytes / GiB:.2f}" \
        in warning


def test_a_host_that_cannot_hold_a_given_offload_is_said():
    choice, _ = _choose(80, host_gib=100, offload=True)
    assert not choice.chosen.fits
    assert "the offload pools of a node take 672.00 GiB of its 100.00 GiB of host memory" in choice.warning()


def test_on_the_cpu_the_fastest_step_is_taken_when_memory_allows():
    """The bench's cpu preset: its pack needs a few hundred MiB; with 8 GiB free nothing is saved (relative cost 1);
    with only what every saving on needs, the cheapest that fits; offload is never a candidate (the host is the
    device)."""
    from packtrain.bench.presets import get_preset
    from packtrain.config import config_from_dict

    preset = get_preset("cpu")
    cfg = config_from_dict({**preset.config, "train": {**preset.config["train"], **AUTO, "device": "cpu"}})
    shape = UnitShape(2048, [64] * 16, [32] * 16)
    roomy = Budget("cpu", 8 * GiB, 8 * GiB, 0, "test", None, "test", 1)
    choice = savings.choose(cfg, shape, 1, roomy)
    assert choice.chosen.savings == StepSavings(lora_in_model_dtype=True, masks_regenerated=True)
    assert choice.chosen.relative_cost == 1.0
    most = StepSavings(activation_checkpointing=True, loss_rows=256, mlp_rows=512, norm_rows=512,
                       lora_in_model_dtype=True, masks_regenerated=True)
    least = memory.estimate_for_unit(cfg, shape, 1, savings=most).total()
    tight = savings.choose(cfg, shape, 1, dataclasses.replace(roomy, device_bytes=least))
    none = memory.estimate_for_unit(cfg, shape, 1, savings=choice.chosen.savings).total()
    assert none > least and tight.chosen.fits and tight.chosen.device_bytes <= least
    assert tight.chosen.relative_cost > 1.0
    assert all(c.relative_cost >= tight.chosen.relative_cost for c in tight.candidates if c.fits)
    assert {c.savings.offload_layers for c in tight.candidates} == {0}


def test_the_tiles_are_the_back_ends():
    from packtrain.packed.kernels import select_backend

    for device in ("cpu", "cuda"):
        backend = select_backend("torch", device)
        assert (savings.TILE_ROWS[device]["mlp"], savings.TILE_ROWS[device]["norm"]) == (backend.mlp_rows,
                                                                                         backend.norm_rows)


def test_the_largest_budget_keeps_the_reserve():
    cfg = _config()
    budget = plan_budget(cfg, 64, 80.0, 8, None)
    found = savings.max_token_budget(cfg, SEED, 64, budget, 80.0)
    assert found["device_budget_bytes"] == budget.device_bytes == 80 * GiB - found["reserve_bytes"]
    assert found["reserve_bytes"] >= 4 * GiB
    assert found["estimate_bytes"] <= budget.device_bytes
    s = StepSavings(**found["savings"])
    n = found["continuations"]
    mean = sum(SEED.lengths) / len(SEED.lengths)
    above = memory.estimate_for_unit(cfg, UnitShape(64_000, [round(mean)] * (n + 2), [302] * (n + 2)), 64, savings=s)
    assert above.total() > budget.device_bytes  # a few continuations more do not fit


# -- through the command line ----------------------------------------------------------------------------------------
def _seed_like_config(tmp_path):
    """configs/qwen3.6-27b.yaml (every saving auto) on a smaller seed-like pack: P 20,000 + 8 continuations."""
    sys.path.insert(0, str(REPO / "tools" / "data"))
    from make_seed_data import seed_records

    data = tmp_path / "seed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in seed_records(20_000, 8, 248_320, 0)))
    return ["plan", str(SEED_CONFIG), "--set", f"data.train={data}", "--set", "data.format=pretokenized",
            "--memory", "--world-size", "64", "--ranks-per-node", "8"]


def test_plan_memory_json_reports_the_choice(tmp_path):
    args = _seed_like_config(tmp_path)
    roomy = json.loads(run_in_process(*args, "--gpu-memory", "80", "--json").stdout)["memory"]
    tight = json.loads(run_in_process(*args, "--gpu-memory", "24", "--host-memory-per-node", "64",
                                      "--json").stdout)["memory"]
    for mem, gpu in ((roomy, 80), (tight, 24)):
        s = mem["savings"]
        assert isinstance(s["activation_checkpointing"], bool) and isinstance(s["offload_layers"], int)
        assert all(isinstance(s[k], int) for k in ("loss_rows", "mlp_rows", "norm_rows"))
        assert mem["device_budget_bytes"] == gpu * GiB - device_reserve(gpu * GiB)
        assert mem["total_device_bytes"] == max(mem["phases"].values()) <= mem["device_budget_bytes"]
        chosen = mem["choice"]["candidates"][mem["choice"]["chosen"]]
        assert chosen["savings"] == s and chosen["total_device_bytes"] == mem["total_device_bytes"]
        assert chosen["relative_step_cost"] == mem["relative_step_cost"] >= 1.0
        assert mem["budget_search"]["reserve_bytes"] == device_reserve(gpu * GiB)
        assert mem["budget_search"]["estimate_bytes"] <= mem["device_budget_bytes"]
    # less memory: more savings, a higher cost, and within 64 GiB of host per node (8 GiB per rank, 25 layer inputs
    # of 0.32 GiB) the inputs that go to the host
    assert tight["relative_step_cost"] > roomy["relative_step_cost"]
    assert tight["savings"]["offload_layers"] <= 8 * GiB // (5 * 2**26) == 25
    assert tight["node"]["host_per_node_bytes"] <= 64 * GiB
    text = run_in_process(*args, "--gpu-memory", "24").stdout
    assert "memory savings by need: 20.80 GiB per GPU (--gpu-memory 24: 24.00 GiB less a 3.20 GiB reserve)" in text
    assert len([line for line in text.splitlines() if line.startswith("  ->")]) == 1


def test_the_run_header_prints_the_candidates(tmp_path):
    out = run_in_process("train", write_config(tmp_path, train={"max_steps": 1}, data={"eval": None})).stdout
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  memory savings by need: "))
    memory = next(i for i, line in enumerate(lines) if line.startswith("  memory: "))
    assert memory < at and lines[memory].startswith("  memory: no checkpointing, loss whole, MLP whole, norms whole: "
                                                    "about ")
    # the tiny model: every candidate fits, so one line says so (no saving taken: the fastest step), not 16 rows
    assert re.fullmatch(r"  memory savings by need: all 16 combinations fit \(at most [\d.]+ of [\d.]+ GiB per "
                        r"rank\), the fastest taken", lines[at]), lines[at]
    assert not lines[at + 1].startswith("    ->")


def test_an_offload_above_the_layer_count_is_refused(tmp_path):
    """train.offload: 99 on a model of fewer decoder layers, through `train`: refused in one line before the model
    trains (without the refusal it ran "99 of 2 layer inputs in host memory")."""
    from cli_helpers import TINY_MODEL, run_in_process, write_config

    cfg = write_config(tmp_path, train={"offload": 99, "activation_checkpointing": True}, data={"eval": None})
    proc = run_in_process("train", cfg, check=False)
    layers = TINY_MODEL["num_hidden_layers"]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"train.offload: 99 layers, but the model has {layers} decoder layers" in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "adapter").exists()


def test_the_largest_budget_search_offloads_where_the_config_lets_it():
    """The 27B at 80 GiB, every saving auto: the largest budget keeps layer inputs in host memory and fits more
    positions than with train.offload false (with the search's offload forced to 0 the two were equal, unseen)."""
    budget = plan_budget(_config(), 64, 80.0, 8, None)
    auto = savings.max_token_budget(_config(), SEED, 64, budget, 80.0)
    off = savings.max_token_budget(_config(offload=False), SEED, 64, budget, 80.0)
    assert StepSavings(**auto["savings"]).offload_layers > 0 and StepSavings(**off["savings"]).offload_layers == 0
    assert auto["token_budget"] > off["token_budget"] > 0
