"""The GPU bring-up (tools/gpu/check.py, tools/gpu/verdicts.py) on CPU: the dry run passes, and fails naming the step
when a wheel is missing or wrong or the steps' limits exceed the device's; a part run here leaves a verdict (decided,
or FAIL with the reason) for everything it owes, in at most the files that come back; the verdicts' code paths at
tiny shapes."""

import importlib.util
import json
import os
import subprocess
import sys
import zipfile

import pytest
from cli_helpers import REPO

_spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu" / "check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)  # its dataclass reads its module
_spec.loader.exec_module(gpu_check)


def _run(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def _fake_wheels(folder, skip=(), version_of=None):
    """Wheels with the names and metadata the dry run reads (no code): what tools/fetch_gpu_wheels.sh fetches."""
    folder.mkdir()
    for name, version in gpu_check.WHEELS:
        if name in skip:
            continue
        stem = f"{name.replace('-', '_')}-{version}"
        with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as z:
            z.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\n"
                       f"Version: {(version_of or {}).get(name, version)}\n")
    return folder


def test_the_dry_run_passes_with_every_wheel_and_the_limits_as_they_are(tmp_path):
    proc = _run("tools/gpu/check.py", "--dry-run", env={"GPU_CHECK_WHEELS": str(_fake_wheels(tmp_path / "w"))})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout and "11 of 11 checks ok" in proc.stdout


def test_a_missing_wheel_fails_the_wheels_step_naming_it(tmp_path):
    proc = _run("tools/gpu/check.py", "--dry-run", env={"GPU_CHECK_WHEELS": str(_fake_wheels(tmp_path / "w",
                                                                                            skip=("peft",)))})
    assert proc.returncode == 1
    assert "FAIL wheels" in proc.stdout and "peft==0.21.2 missing" in proc.stdout


def test_a_wheel_whose_metadata_is_another_version_fails(tmp_path):
    folder = _fake_wheels(tmp_path / "w", version_of={"transformers": "5.17.0"})
    proc = _run("tools/gpu/check.py", "--dry-run", env={"GPU_CHECK_WHEELS": str(folder)})
    assert proc.returncode == 1 and "its metadata says transformers 5.17.0" in proc.stdout


def test_limits_over_the_device_fail_the_budget_naming_the_part_and_its_steps(tmp_path):
    env = {"GPU_CHECK_WHEELS": str(_fake_wheels(tmp_path / "w")), "GPU_CHECK_LIMITS": "kernels=400"}
    proc = _run("tools/gpu/check.py", "--dry-run", env=env)
    assert proc.returncode == 1
    assert "FAIL budget: part 1" in proc.stdout and "kernels 400 s" in proc.stdout
    assert "over 480 s per command" in proc.stdout and "FAIL budget: device time" in proc.stdout
    assert "ok   budget: part 2" in proc.stdout


def test_the_parts_fit_the_device_as_written():
    lim = gpu_check.limits()
    assert all(gpu_check.part_seconds(p, lim) <= gpu_check.COMMAND_LIMIT_S for p in (1, 2))
    assert gpu_check.START_S + sum(gpu_check.part_seconds(p, lim) for p in (1, 2)) <= gpu_check.DEVICE_S
    assert len(gpu_check.OUTPUTS) <= gpu_check.MAX_FILES


@pytest.mark.process
def test_a_part_that_runs_out_of_time_leaves_a_verdict_for_everything_it_owes(tmp_path):
    """Part 1 on this CPU machine with the kernel steps given 2 s: the versions verdict decided (PASS here), every
    verdict of a step that ran past its limit a FAIL saying so; the table and the log in $OUT, nothing else."""
    out = tmp_path / "out"
    env = {"OUT": str(out), "GPU_CHECK_WHEELS": str(tmp_path / "none"),
           "GPU_CHECK_LIMITS": "kernels=2,parity=2,tests=2"}
    proc = _run("tools/gpu/check.py", "1", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {r["verdict"]: r for r in map(json.loads, (out / "verdicts.jsonl").read_text().splitlines())}
    owed = [v for s in gpu_check.STEPS if s.part == 1 for v in s.verdicts]
    assert list(rows) == owed
    assert rows["versions"]["pass"], rows["versions"]
    for name in owed[1:]:
        assert not rows[name]["pass"] and "ran past its 2 s" in rows[name]["detail"], rows[name]
    assert sorted(p.name for p in out.iterdir()) == sorted(gpu_check.OUTPUTS[:3])  # part 2's log is part 2's
    assert "# GPU check: 1 PASS, 5 FAIL" in (out / "verdicts.md").read_text()


@pytest.mark.process
def test_the_verdicts_decide_at_tiny_shapes_on_cpu(tmp_path):
    """Every verdict with a CPU form, at tiny shapes (fla under Triton's interpreter, the dense attention in
    FlexAttention's place, the torch back end in the step's), decided and passed: the code a GPU run executes."""
    names = ["versions", "flex", "gdn", "parity", "speed", "offload"]
    proc = _run("tools/gpu/verdicts.py", *names, "--tiny", env={"OUT": str(tmp_path), "TRITON_INTERPRET": "1"},
                timeout=600)
    rows = {r["verdict"]: r for r in map(json.loads, (tmp_path / "verdicts.jsonl").read_text().splitlines())}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(rows) == {*names, "gdn_kernel"} and all(r["pass"] for r in rows.values()), rows
    assert "fla Triton ran (0 FlashQLA calls)" in rows["gdn_kernel"]["measured"]


def test_every_listed_verdict_can_be_asked_for():
    """What `verdicts.py --list` names (what the script decides) is what it takes as NAME: gdn_kernel was listed and
    refused (the gdn run decides it; either name runs it now)."""
    spec = importlib.util.spec_from_file_location("gpu_verdicts", REPO / "tools" / "gpu" / "verdicts.py")
    verdicts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verdicts)
    assert list(verdicts.VERDICTS) == list(verdicts.NAMES)
    assert verdicts.VERDICTS["gdn_kernel"] is verdicts.VERDICTS["gdn"]
