"""What the commands print, read as a new user reads it (issue 57, "Dense output"): every line of `plan` within 120
columns, the savings' table only where the choice was a trade-off, a CPU run's header in the CPU's words, and the
bench's figures without goals of its own. Through the real command line, in this process."""

import json
import re
import sys

import pytest
from cli_helpers import REPO, run_in_process, write_config

QWEN = REPO / "configs" / "qwen3.6-27b.yaml"
WIDTH = 120


def _widest(text: str) -> tuple[int, str]:
    return max((len(line), line) for line in text.splitlines())


def _seed_like(tmp_path):
    """The 27B config on data of the seed's shape, smaller (P 20,000 + 8 continuations of 600-1,100 positions)."""
    sys.path.insert(0, str(REPO / "tools" / "data"))
    from make_seed_data import seed_records

    data = tmp_path / "seed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in seed_records(20_000, 8, 248_320, 0)))
    return ["--set", f"data.train={data}", "--set", "data.format=pretokenized"]


@pytest.mark.parametrize("flags", [[], ["--gpu-memory", "80", "--world-size", "64", "--ranks-per-node", "8"],
                                   ["--gpu-memory", "24", "--host-memory-per-node", "64", "--world-size", "64"]],
                         ids=["80-assumed", "80-64-ranks", "24-tight"])
def test_plan_memory_on_the_27b_fits_120_columns(tmp_path, flags):
    """`plan --memory configs/qwen3.6-27b.yaml` printed 28 lines over 120 columns, one of 502 (the terms table's
    GiB column after its longest label): every line fits now, with and without the data, and says what it said."""
    data = _seed_like(tmp_path)
    for args in (data, []):  # the seed-like data; none (the config's data/train.jsonl is not in the repository)
        out = run_in_process("plan", QWEN, "--memory", *args, *flags).stdout
        assert _widest(out)[0] <= WIDTH, _widest(out)
        assert "total on the device" in out and "peak per phase" in out and "each packing.context_grad" in out
    if flags:
        assert "largest packing.token_budget fitting" in out


def test_plan_measure_and_every_table_fit_120_columns(tmp_path):
    """--measure's column and notes, a tree plan's rows, the steps at several ranks, the savings' table."""
    cfg = write_config(tmp_path, model={"kernels": "fla", "dtype": "bfloat16"})
    measured = run_in_process("plan", cfg, "--memory", "--measure", "--gpu-memory", "0.05").stdout
    assert "measured" in measured and "->" in measured  # the count beside the estimate; the table: a trade-off
    tree = run_in_process("plan", cfg, "--world-size", "4", "--set", "packing.mode=tree").stdout
    for out in (measured, tree):
        assert _widest(out)[0] <= WIDTH, _widest(out)
    assert "utilisation (mean / largest rank cost per step, epoch 0) cost" in tree


def test_a_choice_that_traded_nothing_is_one_line(tmp_path):
    """A tiny model on an 80 GiB GPU: every combination of the savings fits, the fastest (none) is taken, and the 16
    rows of candidates are noise: one line says so. --json keeps every candidate. A choice that trades (the 27B
    at 24 GiB) still prints its table, the chosen row marked."""
    cfg = write_config(tmp_path)
    out = run_in_process("plan", cfg, "--memory").stdout
    [line] = [x for x in out.splitlines() if x.startswith("memory savings by need: ")]
    assert re.fullmatch(r"memory savings by need: all 16 combinations fit \(at most \d+\.\d\d of 74\.00 GiB per GPU\), "
                        r"the fastest taken", line), line
    assert "->" not in out and "step cost" not in out
    choice = json.loads(run_in_process("plan", cfg, "--memory", "--json").stdout)["memory"]["choice"]
    assert len(choice["candidates"]) == 16 and all(c["fits"] for c in choice["candidates"])
    traded = run_in_process("plan", QWEN, "--memory", "--gpu-memory", "24", "--world-size", "64").stdout
    assert len([x for x in traded.splitlines() if x.startswith("  ->")]) == 1 and "does not fit" in traded


def test_a_cpu_runs_header_speaks_of_the_cpu(tmp_path):
    """A CPU run's header said "GiB per GPU" and "1 steps": the estimate is a rank's on the CPU, and one is
    singular. The savings' one line, not their table."""
    cfg = write_config(tmp_path, data={"eval": None}, train={"max_steps": 1, "packs_per_step": 1})
    header = run_in_process("train", cfg).stdout  # with the steps' lines and the footer: none says GPU either
    assert "GPU" not in header, header
    assert "GiB per rank at the largest unit" in header
    assert re.search(r"^  1 step \(6 per epoch, 1 pack per step\), ", header, re.MULTILINE), header
    assert "memory savings by need: all 16 combinations fit" in header and "  ->" not in header


def test_bench_prints_figures_not_goals(tmp_path):
    """`packtrain bench` printed "goal (wall) ... (NOT met: >= 1.0)": goals of its own, as if they were the user's.
    Its figures and ratios stay; bench.json holds no goal."""
    out = run_in_process("bench", "--preset", "tiny", "--out", tmp_path / "bench", "--repeats", "1",
                         "--no-warmup").stdout
    assert "x shared" in out and "of ratio (CPU time): " in out
    assert not re.search(r"\bgoals?\b|\bmet\b|>=", out, re.IGNORECASE), out
    result = (tmp_path / "bench" / "bench.json").read_text()
    assert not re.search(r"goal|\bmet\b", result, re.IGNORECASE)
