"""The harness of `smoke`, `pretune-fla` and `plan --measure` (packtrain/run/harness.py): the one-pack plan of the
plan's largest unit (P cut for pretune-fla, its attention pairs recounted by hand), what counts as out of memory,
and the measured phases with the CPU's peak-memory probe."""

from types import SimpleNamespace

import pytest
import torch
from cli_helpers import run_ranks, write_config

from packtrain.config import load_config
from packtrain.data.jsonl import load_split
from packtrain.run import harness
from packtrain.run.units import Kinds, build, largest_unit, plan_for


def test_shortened_prompt_keeps_the_continuations(tmp_path):
    """pretune-fla's one-pack plan: P cut to its first tokens, the largest pack's continuations as planned."""
    cfg = load_config(write_config(tmp_path))
    examples = load_split(cfg, "train")
    plan = plan_for(cfg, examples)
    kinds = Kinds.named("shared_prefix")
    unit = largest_unit(plan, examples, kinds)
    full, _ = harness.one_pack(plan, examples, kinds)
    short, short_unit = harness.one_pack(plan, examples, kinds, prompt_tokens=5)
    assert short.prompts == [plan.prompts[unit.prompt][:5]] and full.prompts == [plan.prompts[unit.prompt]]
    assert short_unit.examples == unit.examples and len(short.packs) == 1
    full_layout, short_layout = (build(kinds.units(p.packs[0])[0], p, examples, kinds).work for p in (full, short))
    assert short_layout.prefix_len == 5 and full_layout.length - short_layout.length == full_layout.prefix_len - 5
    assert short.packs[0].positions == short_layout.length and full.packs[0].positions == full_layout.length
    assert torch.equal(short_layout.target_ids, full_layout.target_ids)


def test_the_one_pack_plan_of_a_standalone_run_is_its_largest_example(tmp_path):
    cfg = load_config(write_config(tmp_path))
    examples = load_split(cfg, "train")
    plan = plan_for(cfg, examples)
    kinds = Kinds.named("standalone")
    one, unit = harness.one_pack(plan, examples, kinds)
    assert unit == largest_unit(plan, examples, kinds) and one.packs[0].examples == unit.examples
    assert one.packs[0].positions == build(unit, one, examples, kinds).positions  # prompt 0 of the one-pack plan


def test_cpu_allocator_failure_counts_as_out_of_memory():
    assert harness.is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: "
                                                 "can't allocate memory: you tried to allocate 100 bytes"))
    assert not harness.is_out_of_memory(RuntimeError("shape mismatch"))


def test_the_one_pack_plans_pairs_are_counted_for_the_cut_prompt(tmp_path):
    """The cost model reads the pack's pairs: with P cut to 5 tokens, P's own 1 + ... + 5, every continuation token
    reading P's 5 keys, and each continuation's own 1 + ... + c."""
    cfg = load_config(write_config(tmp_path))
    examples = load_split(cfg, "train")
    plan = plan_for(cfg, examples)
    kinds = Kinds.named("shared_prefix")
    full, unit = harness.one_pack(plan, examples, kinds)
    short, _ = harness.one_pack(plan, examples, kinds, prompt_tokens=5)
    lengths = [examples[e].len_continuation for e in unit.examples]
    assert len(lengths) > 1  # several continuations, so each one's own pairs count apart
    p = len(plan.prompts[unit.prompt])
    assert full.packs[0].attention_pairs == p * (p + 1) // 2 + sum(p * c + c * (c + 1) // 2 for c in lengths)
    assert short.packs[0].attention_pairs == 15 + sum(5 * c + c * (c + 1) // 2 for c in lengths)
    assert short.packs[0].positions == 5 + sum(lengths) and short.skipped == []


def test_on_every_rank_gives_each_rank_the_one_pack():
    step = SimpleNamespace(info=SimpleNamespace(world_size=3))
    assert harness.on_every_rank(step) == [0, 0, 0]  # rank r runs ids r, r + 3, ...: pack 0 on each


def test_a_phase_records_its_time_and_peak_and_names_an_out_of_memory_error():
    class Probe:
        resets = 0

        def reset(self):
            self.resets += 1

        def read(self):
            return 1234, 5678

    phases, probe = [], Probe()
    assert harness.run_phase(phases, probe, "update 1", lambda: "done") == "done"

    def runs_out():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.27 GiB\nmore detail")

    with pytest.raises(torch.OutOfMemoryError):
        harness.run_phase(phases, probe, "update 2", runs_out)
    with pytest.raises(ValueError):
        harness.run_phase(phases, probe, "save", lambda: int("x"))
    assert [(p.name, p.allocated, p.reserved, p.error) for p in phases] == [
        ("update 1", 1234, 5678, None),
        ("update 2", 1234, 5678, "out of memory: CUDA out of memory. Tried to allocate 2.27 GiB"),
        ("save", 1234, 5678, None)]  # another error is not an out-of-memory one, and is not named as one
    assert probe.resets == 3 and all(p.seconds >= 0 for p in phases)


_PROBE_SCRIPT = """
import re
from pathlib import Path

import torch

from packtrain.run import harness


def resident():
    status = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\\s+(\\d+) kB", status).group(1)) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}


probe = harness.PeakMemory(torch.device("cpu"))
earlier = torch.ones(256 * 2**20, dtype=torch.uint8)
del earlier  # a large block is unmapped when freed: the resident set falls back, its peak stays
probe.reset()
before = resident()
block = torch.ones(64 * 2**20, dtype=torch.uint8)
alive = resident()
peak, reserved = probe.read()
after = resident()
del block
said = f"peak {peak}, resident before {before}, with the block {alive}, after the peak's reading {after}"
assert alive["RssAnon"] - before["RssAnon"] >= 60 * 2**20, said  # the block is resident: the premise
reclaimed = max(0, before["RssFile"] - min(alive["RssFile"], after["RssFile"]))
assert reserved is None and before["VmRSS"] - reclaimed + 60 * 2**20 <= peak, said
assert probe.since_start or peak < before["VmRSS"] + 160 * 2**20, said
print("measured", said)
"""


@pytest.mark.process
def test_the_cpu_probe_sees_a_new_allocation_after_its_reset():
    """VmHWM in bytes since the reset: 64 MiB written after it raise the peak by about that much, and 256 MiB freed
    before it do not count (where the reset is refused, the peak is the process's since it started, and only the
    lower bound holds). It measures in a process of its own, forked from the suite's rank server: in a test worker,
    threads that earlier tests left behind free memory at any moment (a CI run saw the anonymous resident set rise
    by 32 MiB with the 64 MiB block alive). The file-backed part of the resident set (the mapped pages of torch's
    and the other libraries) is not the test's to hold either: the kernel reclaims clean file pages under memory
    pressure, so the bound counts what of it the kernel took between the reading before and the peak's."""
    out = run_ranks(1, script=_PROBE_SCRIPT, timeout=60).stdout
    assert "measured peak" in out


def test_memory_errors_of_either_kind_count_as_out_of_memory():
    assert harness.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert harness.is_out_of_memory(MemoryError())
    assert not harness.is_out_of_memory(ValueError("can't allocate memory"))  # only a RuntimeError says it so
