"""`packtrain smoke` on CPU with a tiny model: the phase table, the checkpoint, and out-of-memory naming its phase."""

import argparse
import re

import pytest
import torch
from cli_helpers import REPO, run_in_process, write_config

from packtrain.commands import smoke
from packtrain.config import load_config
from packtrain.data.jsonl import load_split
from packtrain.run import harness
from packtrain.run.units import Kinds, largest_unit, plan_for

PHASES = ["load model", "update 1", "update 2 (with optimizer state)", "save checkpoint"]


def test_smoke_prints_every_phase_and_saves_outside_the_run_checkpoints(tmp_path):
    cfg = write_config(tmp_path, lora={"dropout": 0.05}, train={"activation_checkpointing": True})
    out = run_in_process("smoke", cfg).stdout
    lines = out.splitlines()
    loaded = load_config(cfg)
    largest = max(p.positions for p in plan_for(loaded, load_split(loaded, "train")).packs)
    # the savings it takes, as train would take them, before anything runs; then the table
    assert lines[0].startswith("  memory: ") and re.match(r"  memory savings by need: all \d+ combinations fit", lines[1])
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("smoke: ")):]
    assert lines[0].startswith(f"smoke: the largest pack, {largest:,} positions") and "device cpu" in lines[0]
    assert lines[1].split() == ["phase", "peak", "RSS", "GiB", "seconds"]
    for name, line in zip(PHASES, lines[2:6]):
        assert line.strip().startswith(name)
        assert float(line.split()[-2]) > 0  # peak RSS in GiB
    assert (tmp_path / "run" / "smoke" / "checkpoints" / "step-2" / "state.json").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()  # resume never sees the smoke checkpoint


def test_the_largest_unit_is_the_pack_with_most_positions(tmp_path):
    cfg = load_config(write_config(tmp_path))
    examples = load_split(cfg, "train")
    plan = plan_for(cfg, examples)
    unit = largest_unit(plan, examples, Kinds.named("shared_prefix"))
    assert max(p.positions for p in plan.packs) == next(p.positions for p in plan.packs
                                                        if (p.prompt, p.examples) == (unit.prompt, unit.examples))
    alone = largest_unit(plan, examples, Kinds.named("standalone"))
    lengths = [len(plan.prompts[p.prompt]) + examples[e].len_continuation for p in plan.packs for e in p.examples]
    assert len(alone.examples) == 1
    assert len(plan.prompts[alone.prompt]) + examples[alone.examples[0]].len_continuation == max(lengths)


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")
def test_out_of_memory_exits_non_zero_naming_the_phase(tmp_path, monkeypatch, capsys):
    calls = []

    def update_that_runs_out_on_the_second_call(*args):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.27 GiB")
        return 1.0

    monkeypatch.setattr(harness, "one_update", update_that_runs_out_on_the_second_call)
    args = argparse.Namespace(config=str(write_config(tmp_path)), overrides=[])
    assert smoke.run_smoke(args) == smoke.OUT_OF_MEMORY_EXIT
    captured = capsys.readouterr()
    assert "packtrain smoke: out of memory in phase 'update 2 (with optimizer state)' on rank 0" in captured.err
    rows = [line.strip() for line in captured.out.splitlines()]
    assert rows[-1].startswith("update 2 (with optimizer state)") and "out of memory: CUDA out of memory" in rows[-1]
    assert not any(r.startswith("save checkpoint") for r in rows)


def test_smoke_runs_the_pack_in_continuation_groups(tmp_path):
    cfg = write_config(tmp_path, packing={"continuation_groups": 3})
    first = _title(run_in_process("smoke", cfg).stdout)
    assert "continuations in 3 groups," in first, first


def test_smoke_walks_an_example_over_the_budget(tmp_path, capsys):
    """Every example over packing.token_budget: the largest unit is walked, chunk by chunk, as training walks it."""
    cfg = write_config(tmp_path, packing={"on_overflow": "walk", "token_budget": 8, "walk": {"chunk": 4}})
    assert smoke.run_smoke(argparse.Namespace(config=str(cfg), overrides=[])) == 0
    first = _title(capsys.readouterr().out)
    assert first.startswith("smoke: the largest walked example,") and " chunks, " in first, first


def _title(out: str) -> str:
    """smoke's table title (after the memory savings' lines)."""
    return next(line for line in out.splitlines() if line.startswith("smoke: "))


def test_smoke_runs_on_the_vision_language_demo(tmp_path):
    """configs/vlm_demo.yaml: the pack's images are loaded by the step's build, as the trainer's are."""
    out = run_in_process("smoke", REPO / "configs" / "vlm_demo.yaml", "--set", f"output_dir={tmp_path / 'run'}",
                         "--set", "packing.max_continuations=4").stdout
    title = _title(out)
    assert title.startswith("smoke: the largest pack,") and "(4 continuations," in title, title
    assert (tmp_path / "run" / "smoke" / "checkpoints" / "step-2" / "state.json").exists()


@pytest.mark.parametrize("reference", ["precompute", "per_step"])
def test_smoke_runs_a_dpo_config_without_a_reference_table(tmp_path, reference):
    """dpo, no reference.json anywhere: smoke's step takes its reference as train's would (precompute: the pack's
    reference computed for it, since smoke never makes the table; per_step: in the step), two updates and a save."""
    from cli_helpers import write_pair_data

    pairs = write_pair_data(tmp_path / "pairs.jsonl")
    cfg = write_config(tmp_path, data={"train": str(pairs), "eval": None},
                       train={"objective": "dpo", "dpo_reference": reference})
    out = run_in_process("smoke", cfg).stdout
    assert "update 2" in out and "save checkpoint" in out, out
    assert not (tmp_path / "run" / "reference.json").exists()
