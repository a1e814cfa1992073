"""Two ranks over gloo with FSDP2 (parameters really sharded) against one rank, through the real CLI: the ranks as
processes (forked with packtrain imported: cli_helpers.run_ranks; under torchrun from the launch script), the 1-rank
runs in this process. Holds the suite's proof of resuming a 2-rank checkpoint on 1 rank (a 2-rank resume:
test_preemption's SIGINT)."""

import json
import os
import subprocess

import pytest
import torch
from cli_helpers import REPO, RULEBOOKS, SGD, adapter_of, run_in_process, run_ranks, write_config, write_model_dir

pytestmark = [pytest.mark.distributed, pytest.mark.process]


def _steps(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if json.loads(x).get("split") != "eval"]


def _assert_same(a, b, exact=False):
    assert a.keys() == b.keys() and a
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:  # float64: only the order of the cross-rank sums differs
            torch.testing.assert_close(a[name], b[name], rtol=1e-10, atol=1e-13)


# 3 ranks: a world size that is not a power of two, where a world factor in the loss scale changed the rounding at
# the model's float32 casts (grad_norm 1e-8 apart from 1 rank; packtrain/models/wrap.py); and a dummy unit each step.
# The MLPs in 7-row tiles and the norms in 5-row tiles, 2 of the 3 layers' inputs offloaded (the third kept on the
# device): each recompute under FSDP2's gathered parameters.
@pytest.mark.parametrize("mode,world", [("shared_prefix", 2), ("standalone", 2), ("shared_prefix", 3)])
def test_two_ranks_equal_one_rank(tmp_path, trained, mode, world):
    # the 1-rank run of a mode is trained once (conftest's `trained`): 2 and 3 ranks compare with the same one
    one = trained(train={"max_steps": 3, "packs_per_step": 2, "mlp_chunk_rows": 7, "norm_chunk_rows": 5,
                         "offload": 2}, packing={"mode": mode}, data={"eval": None})
    two = run_ranks(world, "train", str(one.config), "--set", f"output_dir={tmp_path / 'two'}")
    line = next(x for x in two.stdout.splitlines() if f"FSDP2 over {world} ranks" in x)
    held, total = (int(v.replace(",", "")) for v in line.split("holds ")[1].split(" parameter")[0].split(" of "))
    assert held < 1.2 * total / world, line  # really sharded: each rank holds about its share
    _assert_same_steps(_steps(one.run), _steps(tmp_path / "two"))
    _assert_same(adapter_of(one.run), adapter_of(tmp_path / "two"))


def test_float32_adapters_on_two_ranks_give_the_one_rank_adapter(tmp_path):
    """Float32 adapters, as on every real run (a bf16 base; here a float32 one, which CPUs run faster): FSDP reduces
    float32 gradients, where it would use PREMUL_SUM (which gloo refuses) unless told to sum only. One pack per
    rank: the two ranks' sum is the one rank's accumulation, bit for bit."""
    cfg = write_config(tmp_path, model={"dtype": "float32"}, optim=SGD,
                       train={"max_steps": 2, "packs_per_step": 2}, data={"eval": None})
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'one'}")
    run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'two'}")
    one, two = adapter_of(tmp_path / "one"), adapter_of(tmp_path / "two")
    assert {t.dtype for t in one.values()} == {torch.float32}
    _assert_same(one, two, exact=True)
    for a, b in zip(_steps(tmp_path / "one"), _steps(tmp_path / "two"), strict=True):
        assert a["loss"] == b["loss"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)  # float32 norms of other shards


def test_chunked_loss_with_a_trained_head_on_two_ranks_gives_the_one_rank_adapter(tmp_path):
    """train.loss_chunk_rows 3 with the untied head trained (modules_to_save): under FSDP2 the head's chunks run as
    that unit's forward, so its weight is gathered around every chunk and its recompute, and its gradient, summed
    over the chunks, is reduced once."""
    cfg = write_config(tmp_path, train={"max_steps": 2, "packs_per_step": 2, "loss_chunk_rows": 3},
                       lora={"modules_to_save": ["lm_head"]}, data={"eval": None})
    one = run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'one'}")
    assert "loss: lm_head + cross-entropy in chunks of 3 target rows (recomputed in backward)" in one.stdout
    run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'two'}")
    one, two = adapter_of(tmp_path / "one"), adapter_of(tmp_path / "two")
    assert any("lm_head" in name for name in one)
    _assert_same(one, two)
    _assert_same_steps(_steps(tmp_path / "one"), _steps(tmp_path / "two"))


def _assert_same_steps(one, two):
    """The logged loss and gradient norm per step: FSDP left averaging instead of summing halves grad_norm on
    2 ranks, which AdamW's normalisation hides from the adapter (6.5e-6 after 3 steps)."""
    assert [s["examples"] for s in one] == [s["examples"] for s in two] and one
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-10), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-10), (a, b)


def test_model_path_runs_give_one_adapter_on_one_and_two_ranks(tmp_path):
    """LoRA's initialisation comes from train.seed: peft draws it from torch's global RNG, which nothing seeded
    when the base came from model.path (the same config twice gave adapters 1.4 apart, relative, and 2 ranks
    differed from 1 as much)."""
    base = write_model_dir(tmp_path / "base")
    cfg = write_config(tmp_path, model={"path": str(base), "config": None}, train={"max_steps": 2},
                       data={"eval": None})
    # twice in one process: the global RNG is not where a fresh process starts it the second time
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'a'}")
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'b'}")
    _assert_same(adapter_of(tmp_path / "a"), adapter_of(tmp_path / "b"), exact=True)
    run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'two'}")
    _assert_same(adapter_of(tmp_path / "a"), adapter_of(tmp_path / "two"))
    _assert_same_steps(_steps(tmp_path / "a"), _steps(tmp_path / "two"))


def test_over_budget_pack_on_one_rank_is_skipped_by_both(tmp_path):
    from packtrain.config import load_config
    from packtrain.data.jsonl import load_split
    from packtrain.run.balance import step_packs
    from packtrain.run.units import plan_for

    # round robin: the test picks a seed that puts the big pack on rank 1 (balanced steps give it to rank 0)
    cfg_path = write_config(tmp_path, train={"epochs": 1, "packs_per_step": 4, "balance": "round_robin"},
                            data={"eval": None})
    with (tmp_path / "train.jsonl").open("a") as f:  # one clearly longest example makes one largest pack
        f.write(json.dumps({"id": "long", "system": RULEBOOKS[0], "item": "Colour: " + "red " * 12,
                            "target": "alpha"}) + "\n")
    cfg = load_config(cfg_path)
    plan = plan_for(cfg, load_split(cfg, "train"))
    sizes = sorted(p.positions for p in plan.packs)
    assert sizes[-1] > sizes[-2], "the fixture needs one largest pack"
    big = next(i for i, p in enumerate(plan.packs) if p.positions == sizes[-1])

    def big_on_rank1(seed):  # rank r takes packs r, r+2, ... of a step: an odd index is rank 1's
        return any(big in (ids := step_packs(plan, 0, i, 4, seed)) and ids.index(big) % 2 == 1 for i in range(2))

    seed = next(s for s in range(100) if big_on_rank1(s))
    run_ranks(2, "train", str(cfg_path), "--set", f"train.seed={seed}",
                    "--set", f"train.max_positions={sizes[-1] - 1}")
    steps = _steps(tmp_path / "run")
    assert [s["skipped"] for s in steps].count(1) == 1 and sum(s["skipped"] for s in steps) == 1
    assert (tmp_path / "run" / "adapter").exists()
    hit = next(s for s in steps if s["skipped"])
    # the micro-step is skipped on both ranks: the big pack and the pack rank 0 had at the same index
    step_ids = step_packs(plan, 0, steps.index(hit), 4, seed)
    j = step_ids.index(big)
    both = [step_ids[j - 1], big]
    assert hit["skipped_examples"] == sum(len(plan.packs[i].examples) for i in both)
    assert hit["examples"] == sum(len(plan.packs[i].examples) for i in step_ids) - hit["skipped_examples"] > 0
    assert hit["loss"] is not None


def test_checkpoint_from_two_ranks_resumes_on_one(tmp_path):
    cfg = write_config(tmp_path, train={"epochs": 2, "packs_per_step": 2, "save_every": 2}, data={"eval": None})
    run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'one'}")
    killed = run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'moved'}",
                             env={"PACKTRAIN_KILL_AFTER_CHECKPOINT": "2"}, check=False)
    assert killed.returncode != 0 and not (tmp_path / "moved" / "adapter").exists()
    assert (tmp_path / "moved" / "checkpoints" / "step-2" / "rng-rank-1.pt").exists()
    resumed = run_in_process("train", cfg, "--set", f"output_dir={tmp_path / 'moved'}", "--resume")
    assert "written with world size 2, now 1" in resumed.stdout
    _assert_same(adapter_of(tmp_path / "one"), adapter_of(tmp_path / "moved"))


def test_launch_script_runs_the_interpreter_behind_packtrain(tmp_path):
    """launch/cpu_two_processes.sh called a bare `python`, which need not be the one with torch and packtrain:
    here `python` on PATH is a stub that fails, and `packtrain` on PATH names an interpreter that records how the
    script runs it (torchrun itself is what accelerate launch runs too: tests/test_accelerate.py trains that way)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "called.txt"
    (bin_dir / "python").write_text("#!/bin/sh\necho 'a bare python ran' >&2\nexit 97\n")
    (bin_dir / "interpreter").write_text(f"#!/bin/sh\necho \"$@\" > {record}\n")
    (bin_dir / "packtrain").write_text(f"#!{bin_dir / 'interpreter'}\nfrom packtrain.cli import main\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MASTER_PORT": "29777"}
    env.pop("PYTHON", None)
    proc = subprocess.run(["bash", str(REPO / "launch" / "cpu_two_processes.sh"), "cfg.yaml", "--set", "a=b"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert record.read_text().split() == ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                                          "127.0.0.1", "--master_port", "29777", "-m", "packtrain", "train",
                                          "cfg.yaml", "--set", "a=b"]


@pytest.mark.parametrize("values", [[3, 0, 7], [], [0]])
def test_agree_on_one_rank_is_the_values(values):
    from packtrain.distributed import DistInfo, agree

    assert agree(values, DistInfo(0, 1, 0, torch.device("cpu"))) == values

