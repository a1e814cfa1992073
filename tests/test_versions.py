"""The tested dependency ranges (packtrain/versions.py): the check on fake version strings, the refusal through the
CLI, check-nodes' row, the ranks' agreement, a fake install found where the import would load it, and pyproject
stating the same ranges. Nothing here installs anything."""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import tomllib
import torch
from cli_helpers import REPO, refused, run_in_process, write_config

from packtrain import distributed, versions
from packtrain.versions import TESTED, Range, UntestedVersionError

IN_RANGE = {d: rng.floor for d, (_, rng) in TESTED.items()}


@pytest.mark.parametrize("version,holds", [
    ("5.24.0", True), ("5.24.3", True),  # the floor, a patch release of the tested minor
    ("5.23.9", False), ("5.17.0", False), ("5.24.0rc1", False), ("5.24.0.dev0", False),  # below
    ("5.25.0", False), ("5.25.0rc1", False), ("5.25.0.dev20261201", False), ("6.0", False),  # above
    ("5.24.0+local", True), ("5.25.0+local", False),  # a local build is the release it builds
    ("not a version", False),
])
def test_transformers_range_on_fake_version_strings(version, holds):
    assert Range("5.24.0", "5.25").holds(version) is holds


@pytest.mark.parametrize("version,holds", [("2.11.0+cu130", True), ("2.13.0+cpu", True), ("2.12.1", True),
                                           ("2.10.2+cpu", False), ("2.14.0+cpu", False), ("2.14.0a0+git1234", False)])
def test_torch_range_with_local_build_suffixes(version, holds):
    assert TESTED["torch"][1].holds(version) is holds


def test_findings_name_package_version_and_range():
    found = {**IN_RANGE, "transformers": "5.17.0", "peft": None, "fla-core": None,
             "flash-linear-attention": None, "triton": None}
    assert versions.findings(found) == ["transformers 5.17.0 is outside the tested range >=5.24.0,<5.25",
                                        "peft is not installed (tested >=0.21.0,<0.22)"]  # fla's extra is optional
    assert versions.findings(IN_RANGE) == []


def _fake_versions(monkeypatch, **changed):
    found = {**IN_RANGE, **{k.replace("_", "-"): v for k, v in changed.items()}}
    monkeypatch.setattr(versions, "found_versions", lambda: found)


def test_a_command_refuses_an_untested_version_with_one_line(tmp_path, monkeypatch):
    _fake_versions(monkeypatch, transformers="5.17.0", torch="2.14.0+cpu")
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    proc = run_in_process("train", str(write_config(tmp_path)), check=False)
    err = refused(proc)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("packtrain train: error: ")
    assert "torch 2.14.0+cpu is outside the tested range >=2.11.0,<2.14" in err
    assert "transformers 5.17.0 is outside the tested range >=5.24.0,<5.25" in err
    assert "pip install 'torch>=2.11.0,<2.14' 'transformers>=5.24.0,<5.25'" in err
    assert not (tmp_path / "run").exists() and proc.stdout == ""  # refused before any work


def test_allow_runs_anyway_and_says_so(tmp_path, monkeypatch):
    _fake_versions(monkeypatch, accelerate="1.9.0")
    proc = run_in_process("plan", str(write_config(tmp_path)), "--json",
                          env={versions.ALLOW_ENV: "allow"})
    assert json.loads(proc.stdout)["examples"] > 0
    assert "warning: accelerate 1.9.0 is outside the tested range >=1.15.0,<1.17" in proc.stderr


def test_check_nodes_shows_the_ranges_in_its_table_then_refuses(tmp_path, monkeypatch):
    _fake_versions(monkeypatch, peft="0.17.1")
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    proc = run_in_process("check-nodes", str(write_config(tmp_path)), check=False)
    row = next(x for x in proc.stdout.splitlines() if x.strip().startswith("tested ranges"))
    assert "peft 0.17.1 is outside the tested range >=0.21.0,<0.22" in row
    assert "peft 0.17.1 is outside the tested range" in refused(proc)
    _fake_versions(monkeypatch)
    proc = run_in_process("check-nodes", str(write_config(tmp_path)))
    assert re.search(r"tested ranges\s+all inside", proc.stdout)


def test_ranks_refuse_together_naming_the_ranks():
    distributed._agree_on_versions([(0, []), (1, [])])  # nothing found: nothing refused
    line = "transformers 5.17.0 is outside the tested range >=5.24.0,<5.25"
    with pytest.raises(UntestedVersionError, match=r"transformers 5.17.0 is outside .* \(ranks 2,3\)"):
        distributed._agree_on_versions([(0, []), (1, []), (2, [line]), (3, [line])])


@pytest.mark.process
def test_a_fake_install_ahead_on_the_path_is_what_is_checked(tmp_path):
    """An older transformers earlier on sys.path (as a wheel unpacked over an image's packages would be) is the one
    found, by its folder and the metadata beside it, without importing it."""
    site = tmp_path / "site"
    (site / "transformers").mkdir(parents=True)
    (site / "transformers" / "__init__.py").write_text("raise ImportError('the check must not import this')\n")
    meta = site / "transformers-5.17.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.17.0\n")
    env = {"PYTHONPATH": f"{site}:{REPO}", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    env.pop(versions.ALLOW_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "packtrain", "plan", str(REPO / "configs" / "demo.yaml")],
                          capture_output=True, text=True, env=env, cwd=REPO, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "transformers 5.17.0 is outside the tested range >=5.24.0,<5.25" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_this_process_imports_versions_inside_the_ranges():
    found = versions.found_versions()
    assert found["torch"] == torch.__version__
    assert versions.findings(found) == [], found


def _requirements(pyproject: dict) -> dict[str, str]:
    reqs = pyproject["project"]["dependencies"] + pyproject["project"]["optional-dependencies"]["fla"]
    out = {}
    for r in reqs:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(.*)", r)
        out[m.group(1)] = m.group(2)
    return out


def test_pyproject_states_the_tested_ranges():
    reqs = _requirements(tomllib.loads((REPO / "pyproject.toml").read_text()))
    for distribution, (_, rng) in TESTED.items():
        assert reqs[distribution] == str(rng), distribution


def test_the_floor_pins_are_the_floors():
    out = subprocess.run([sys.executable, "-m", "packtrain.versions", "--floor"], capture_output=True, text=True,
                         cwd=REPO, check=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}).stdout
    assert out.split() == [f"{d}=={rng.floor}" for d, (_, rng) in TESTED.items()]


def test_the_floor_run_is_in_ci():
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci and "make test-floor" in ci
    assert "-m packtrain.versions --floor" in (REPO / "Makefile").read_text()


ONE = SimpleNamespace(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_main=True, enabled=False)


def test_check_nodes_function_raises_after_printing(monkeypatch):
    from packtrain.ops import nodes

    _fake_versions(monkeypatch, triton="3.5.1")
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    printed = []
    with pytest.raises(UntestedVersionError, match="triton 3.5.1"):
        nodes.check_nodes(ONE, printed.append)
    assert "triton 3.5.1 is outside the tested range >=3.6.0,<3.10" in printed[0]


def test_versions_module_imports_nothing_heavy():
    code = ("import sys, packtrain.versions as v; v.found_versions(); "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'fla', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}).stdout
    assert out.strip() == "[]"

