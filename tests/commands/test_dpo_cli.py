"""`packtrain train` with train.objective dpo through the real CLI, on text preference pairs (``system``, ``item``,
``chosen``, ``rejected``) under packing.mode tree: 2 ranks over gloo give the 1-rank adapter (the precomputed
reference, each rank its share of the pass, gathered), and a run resumed from its checkpoint, reading its
OUTPUT/reference.json again, gives the uninterrupted adapter bit for bit. The exactness of the step itself (against
each pair's two sequences alone through transformers + peft) is tests/run/test_objective.py's."""

import json

import pytest
from cli_helpers import (
    RULEBOOKS,
    SGD,
    adapter_of,
    adapter_rel,
    assert_equal_adapters,
    metrics_of,
    run_in_process,
    run_ranks,
    write_config,
)

CODES = ["alpha", "beta", "gamma"]
COLOURS = ["red", "blue", "green"]
# rulebooks A and B's codes per colour; C repeats the colour word
ANSWERS = [dict(zip(COLOURS, CODES)), dict(zip(COLOURS, ["gamma", "alpha", "beta"]))]


def write_pairs(path):
    """A pair per rulebook and colour: the rulebook's answer chosen, another rulebook's rejected."""
    lines = []
    for r, system in enumerate(RULEBOOKS):
        for i, colour in enumerate(COLOURS):
            right = ANSWERS[r][colour] if r < 2 else f"{colour} {colour}"
            wrong = ANSWERS[1 - r][colour] if r < 2 else CODES[i]
            lines.append({"id": f"r{r}-{colour}", "system": system, "item": f"Colour: {colour}",
                          "chosen": f"code {right}", "rejected": f"code {wrong}"})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


# 9 pairs in 6 tree packs (at most 4 answers each), 2 epochs of 2 steps of 3 packs: on 2 ranks, rank 1 runs a
# dummy in every step; a checkpoint after every step
DPO = {"objective": "dpo", "dpo_beta": 0.5, "dpo_reference": "precompute", "epochs": 2, "packs_per_step": 3,
       "save_every": 1}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """(the config, the run directory) of one uninterrupted 1-rank run, in this process."""
    tmp = tmp_path_factory.mktemp("dpo")
    cfg = write_config(tmp, data={"train": str(write_pairs(tmp / "pairs.jsonl")), "eval": None}, optim=SGD,
                       packing={"mode": "tree", "max_continuations": 4}, train=DPO)
    out = run_in_process("train", cfg, "--set", f"output_dir={tmp / 'straight'}")
    assert "dpo (sigmoid, beta 0.5)" in out.stdout, out.stdout
    assert "log-probabilities of the base model (adapter disabled)" in out.stdout, out.stdout
    # what the run is comes first, then its first long pass (it came before the header: issue 57)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("packtrain train: ")
    header_end = next(i for i, line in enumerate(lines) if " trainable parameters," in line)
    assert next(i for i, line in enumerate(lines) if line.startswith("dpo reference: ")) > header_end
    return cfg, tmp / "straight"


def _steps(run_dir):
    return [m for m in metrics_of(run_dir) if m.get("split") != "eval"]


@pytest.mark.process
@pytest.mark.distributed
def test_two_ranks_give_the_one_rank_dpo_adapter(straight, tmp_path):
    cfg, one = straight
    run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / 'two'}")
    assert [m["packs"] for m in _steps(one)] == [3, 3, 3, 3]
    for a, b in zip(_steps(one), _steps(tmp_path / "two"), strict=True):
        assert a["examples"] == b["examples"]
        # float64: the cross-rank sums' order alone differs (tests/test_distributed.py's bounds)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-10), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-10), (a, b)
    assert adapter_rel(adapter_of(tmp_path / "two"), adapter_of(one)) < 1e-10
    # the reference pass, split over the ranks and gathered, wrote the one rank's table
    tables = [json.loads((d / "reference.json").read_text())["log_probs"] for d in (one, tmp_path / "two")]
    assert tables[0].keys() == tables[1].keys() and len(tables[0]) == 18
    assert all(tables[1][k] == pytest.approx(v, rel=1e-12) for k, v in tables[0].items())


# on the process tests' worker (conftest): the 2-rank test's module fixture `straight` is then trained once, not once
# on each worker
@pytest.mark.xdist_group("process")
def test_a_resumed_dpo_run_gives_the_uninterrupted_adapter(straight, tmp_path):
    """Stopped after step 3 (its newest checkpoint: step 2), resumed into the second epoch: the table is read from OUTPUT/reference.json (not computed again), and the
    adapter and every step's loss are the uninterrupted run's bit for bit."""
    cfg, one = straight
    out = tmp_path / "resumed"
    run_in_process("train", cfg, "--set", f"output_dir={out}", "--set", "train.max_steps=3")
    table = (out / "reference.json").read_text()
    # the first run's max_steps given again as the config's (the run recorded it: without this it is finished)
    resumed = run_in_process("train", cfg, "--set", f"output_dir={out}", "--set", "train.max_steps=null", "--resume")
    assert "continuing from" in resumed.stdout and "step-2" in resumed.stdout, resumed.stdout  # the last step: no checkpoint
    assert f"dpo reference: 18 log-probabilities read from {out / 'reference.json'}" in resumed.stdout
    assert (out / "reference.json").read_text() == table
    assert_equal_adapters(adapter_of(out), adapter_of(one))
    assert [m["loss"] for m in _steps(out)] == [m["loss"] for m in _steps(one)]
