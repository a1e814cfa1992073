"""packing.context_grad through the real CLI: printed in the run header, 2 ranks (FSDP2, processes) == 1 rank (in
this process) in each mode, the modes train different adapters, and `packtrain eval` under a mode gives the
forward's losses."""

import json

import pytest
import torch
from cli_helpers import adapter_of, run_in_process, run_ranks, write_config

pytestmark = [pytest.mark.distributed, pytest.mark.process]
MODES = ("kv_only", "frozen")


def _eval(cfg, adapter, out, mode):
    run_in_process("eval", cfg, "--adapter", adapter, "--out", out, "--set", f"packing.context_grad={mode}")
    return [json.loads(line)["loss"] for line in out.read_text().splitlines()]


def test_two_ranks_equal_one_rank_in_each_mode(tmp_path):
    cfg = write_config(tmp_path, train={"max_steps": 2, "packs_per_step": 2}, data={"eval": None})
    adapters = {}
    for mode in MODES:
        one = run_in_process("train", cfg, "--set", f"output_dir={tmp_path / mode}", "--set",
                             f"packing.context_grad={mode}")
        assert f"context_grad {mode} (" in one.stdout, one.stdout
        run_ranks(2, "train", str(cfg), "--set", f"output_dir={tmp_path / (mode + '-2')}", "--set",
                        f"packing.context_grad={mode}")
        a, b = adapter_of(tmp_path / mode), adapter_of(tmp_path / (mode + "-2"))
        assert a.keys() == b.keys() and a
        for name in a:  # float64: only the order of the cross-rank sums differs
            torch.testing.assert_close(a[name], b[name], rtol=1e-10, atol=1e-13)
        adapters[mode] = a
    assert any((adapters["kv_only"][n] - adapters["frozen"][n]).abs().max() > 1e-6 for n in adapters["frozen"])
    # eval: a mode changes the gradient, not the forward (frozen computes P with transformers' own forward, so only
    # its float32 casts round differently: tests/packed/test_parity.py's as-shipped bound)
    plain = _eval(cfg, tmp_path / "frozen" / "adapter", tmp_path / "full.jsonl", "full")
    frozen = _eval(cfg, tmp_path / "frozen" / "adapter", tmp_path / "frozen.jsonl", "frozen")
    assert len(plain) == len(frozen) == 15
    assert max(abs(x - y) / abs(y) for x, y in zip(frozen, plain)) < 5e-6
