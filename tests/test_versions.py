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
from packtrain.versions import NEWEST, TESTED, Range, UntestedVersionError

IN_RANGE = {d: rng.floor for d, (_, rng) in TESTED.items()}
TORCH, TRANSFORMERS = TESTED["torch"][1], TESTED["transformers"][1]
ABOVE_TORCH = f"{TORCH.ceiling}.0+cpu"  # the first release above the range, as the CPU wheel names it


@pytest.mark.parametrize("version,holds", [
    ("5.24.0", True), ("5.24.3", True),  # the floor, a patch release of the tested minor
    ("5.23.9", False), ("5.17.0", False), ("5.24.0rc1", False), ("5.24.0.dev0", False),  # below
    ("5.25.0", False), ("5.25.0rc1", False), ("5.25.0.dev20261201", False), ("6.0", False),  # above
    ("5.24.0+local", True), ("5.25.0+local", False),  # a local build is the release it builds
    ("not a version", False),
    ("1!5.24.0", False),  # an epoch: another numbering than the releases tested (pip's >=5.24.0 refuses it)
])
def test_transformers_range_on_fake_version_strings(version, holds):
    assert Range("5.24.0", "5.25").holds(version) is holds


@pytest.mark.parametrize("version,holds", [
    (f"{TORCH.floor}+cu130", True), ("2.13.0+cpu", True), (f"{NEWEST['torch']}+cu130", True),
    ("2.10.2+cpu", False), (ABOVE_TORCH, False), (f"{TORCH.ceiling}.0a0+git1234", False)])
def test_torch_range_with_local_build_suffixes(version, holds):
    assert TORCH.holds(version) is holds


def test_findings_name_package_version_and_range():
    found = {**IN_RANGE, "transformers": "5.17.0", "peft": None, "fla-core": None,
             "flash-linear-attention": None, "triton": None}
    assert versions.findings(found) == [f"transformers 5.17.0 is outside the tested range {TRANSFORMERS}",
                                        f"peft is not installed (tested {TESTED['peft'][1]})"]  # fla's is optional
    assert versions.findings(IN_RANGE) == []


def _fake_versions(monkeypatch, **changed):
    found = {**IN_RANGE, **{k.replace("_", "-"): v for k, v in changed.items()}}
    monkeypatch.setattr(versions, "found_versions", lambda: found)


def test_a_command_refuses_an_untested_version_with_one_line(tmp_path, monkeypatch):
    _fake_versions(monkeypatch, transformers="5.17.0", torch=ABOVE_TORCH)
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    proc = run_in_process("train", str(write_config(tmp_path)), check=False)
    err = refused(proc)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("packtrain train: error: ")
    assert f"torch {ABOVE_TORCH} is outside the tested range {TORCH}" in err
    assert f"transformers 5.17.0 is outside the tested range {TRANSFORMERS}" in err
    assert f"pip install 'torch{TORCH}' 'transformers{TRANSFORMERS}'" in err
    assert not (tmp_path / "run").exists() and proc.stdout == ""  # refused before any work


def test_allow_runs_anyway_and_says_so(tmp_path, monkeypatch):
    _fake_versions(monkeypatch, accelerate="1.9.0")
    proc = run_in_process("plan", str(write_config(tmp_path)), "--json",
                          env={versions.ALLOW_ENV: "allow"})
    assert json.loads(proc.stdout)["examples"] > 0
    assert f"warning: accelerate 1.9.0 is outside the tested range {TESTED['accelerate'][1]}" in proc.stderr


def test_check_nodes_shows_the_ranges_in_its_table_then_refuses(tmp_path, monkeypatch):
    _fake_versions(monkeypatch, peft="0.17.1")
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    proc = run_in_process("check-nodes", str(write_config(tmp_path)), check=False)
    row = next(x for x in proc.stdout.splitlines() if x.strip().startswith("tested ranges"))
    assert f"peft 0.17.1 is outside the tested range {TESTED['peft'][1]}" in row
    assert "peft 0.17.1 is outside the tested range" in refused(proc)
    _fake_versions(monkeypatch)
    proc = run_in_process("check-nodes", str(write_config(tmp_path)))
    assert re.search(r"tested ranges\s+all inside", proc.stdout)


def test_ranks_refuse_together_naming_the_ranks():
    distributed._agree_on_versions([(0, []), (1, [])])  # nothing found: nothing refused
    line = f"transformers 5.17.0 is outside the tested range {TRANSFORMERS}"
    with pytest.raises(UntestedVersionError, match=r"transformers 5.17.0 is outside .* \(ranks 2,3\)"):
        distributed._agree_on_versions([(0, []), (1, []), (2, [line]), (3, [line])])


@pytest.mark.process
@pytest.mark.parametrize("version", ["5.17.0", "1!5.24.0"])  # older; an epoch (pip's >= refuses it, as packtrain does)
def test_a_fake_install_ahead_on_the_path_is_what_is_checked(tmp_path, version):
    """An older transformers (or one numbered under another epoch) earlier on sys.path (as a wheel unpacked over an
    image's packages would be) is the one found, by its folder and the metadata beside it, without importing it."""
    site = tmp_path / "site"
    (site / "transformers").mkdir(parents=True)
    (site / "transformers" / "__init__.py").write_text("raise ImportError('the check must not import this')\n")
    meta = site / f"transformers-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n")
    env = {"PYTHONPATH": f"{site}:{REPO}", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    env.pop(versions.ALLOW_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "packtrain", "plan", str(REPO / "configs" / "demo.yaml")],
                          capture_output=True, text=True, env=env, cwd=REPO, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"transformers {version} is outside the tested range {TRANSFORMERS}" in proc.stderr
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


def test_the_newest_pins_are_inside_the_ranges_and_set_their_ceilings():
    """Each range ends at the minor release after the newest one tested: a patch release of it is admitted, the
    next minor (not tested) is not."""
    from packaging.version import Version

    assert NEWEST.keys() == TESTED.keys()
    for distribution, (_, rng) in TESTED.items():
        newest = Version(NEWEST[distribution])
        assert rng.holds(NEWEST[distribution]), distribution
        assert Version(rng.ceiling).release == (newest.major, newest.minor + 1), distribution
        assert Version(rng.floor) <= newest, distribution
    out = subprocess.run([sys.executable, "-m", "packtrain.versions", "--newest"], capture_output=True, text=True,
                         cwd=REPO, check=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}).stdout
    assert out.split() == [f"{d}=={NEWEST[d]}" for d in TESTED]


def test_the_floor_and_ceiling_runs_are_in_ci():
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci and "make test-floor" in ci and "make test-ceiling" in ci
    makefile = (REPO / "Makefile").read_text()
    assert "-m packtrain.versions --floor" in makefile and "-m packtrain.versions --newest" in makefile


@pytest.mark.parametrize("value", ["1", "true", "yes", "Allow", "allow "])
def test_only_the_word_allow_lets_an_untested_version_run(monkeypatch, value):
    monkeypatch.setenv(versions.ALLOW_ENV, value)
    with pytest.raises(UntestedVersionError):
        versions.check_versions({**IN_RANGE, "transformers": "5.17.0"})


ONE = SimpleNamespace(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_main=True, enabled=False)


def test_check_nodes_function_raises_after_printing(monkeypatch):
    from packtrain.ops import nodes

    _fake_versions(monkeypatch, triton="3.5.1")
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    printed = []
    with pytest.raises(UntestedVersionError, match="triton 3.5.1"):
        nodes.check_nodes(ONE, printed.append)
    assert f"triton 3.5.1 is outside the tested range {TESTED['triton'][1]}" in printed[0]


def test_versions_module_imports_nothing_heavy():
    code = ("import sys, packtrain.versions as v; v.found_versions(); "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'fla', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}).stdout
    assert out.strip() == "[]"



def test_raising_the_ceiling_rewrites_newest_and_both_files_alike(tmp_path, monkeypatch):
    """tools/versions/raise_ceiling.py (`make ceiling`) on copies: a newer torch moves NEWEST, the range's ceiling in
    versions.py and pyproject.toml to the minor after it; the floors and the other packages stay."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("raise_ceiling", REPO / "tools" / "versions" / "raise_ceiling.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for name in ("VERSIONS", "PYPROJECT"):
        copy = tmp_path / getattr(tool, name).name
        copy.write_text(getattr(tool, name).read_text())
        monkeypatch.setattr(tool, name, copy)
    newer = {**NEWEST, "torch": "2.16.1"}
    changes = tool.rewrite(newer, "2027-01-02", dry_run=False)
    assert changes == [f"torch: newest {NEWEST['torch']} -> 2.16.1, range <{TORCH.ceiling} -> <2.17"]
    text, project = tool.VERSIONS.read_text(), tool.PYPROJECT.read_text()
    assert f'"torch": ("torch", Range("{TORCH.floor}", "2.17"))' in text and '"torch": "2.16.1",' in text
    assert 'NEWEST_READ = "2027-01-02"' in text
    assert f'"torch>={TORCH.floor},<2.17"' in project and f'"transformers{TRANSFORMERS}"' in project
    spec = importlib.util.spec_from_file_location("rewritten", tool.VERSIONS)  # still Python, the ranges hold the pins
    rewritten = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "rewritten", rewritten)  # its dataclasses look their module up
    spec.loader.exec_module(rewritten)
    assert rewritten.TESTED["torch"][1].holds("2.16.1") and rewritten.NEWEST["torch"] == "2.16.1"
