"""The scripts of tools/ (tools/README.md): each folder one purpose, every script's ``--help`` answers (found by
walking the folders, so a new script is run too), no script imports a private name of packtrain, and the README
lists every script.

A Python script's ``--help`` runs in this process (``runpy``, as ``python tools/...`` runs it: its folder first on
``sys.path``), so the torch and transformers this process has imported are not imported again for each; a shell
script's runs in bash."""

import ast
import contextlib
import importlib.util
import io
import runpy
import subprocess
import sys

import pytest
from cli_helpers import REPO

TOOLS = REPO / "tools"
PURPOSES = ("data", "gpu", "bench", "experiments", "versions", "serve")
ENTRY_POINTS = ("gpu_check.sh", "fetch_gpu_wheels.sh")  # named by docs/development.md, docs/operations.md and .ci/run


def _scripts() -> list[str]:
    return sorted(str(p.relative_to(TOOLS)) for p in TOOLS.rglob("*") if p.suffix in (".py", ".sh")
                  and "__pycache__" not in p.parts)


def test_every_script_sits_in_a_folder_of_its_purpose():
    wrong = [s for s in _scripts() if s.split("/")[0] not in PURPOSES and s not in ENTRY_POINTS]
    others = [str(p.relative_to(TOOLS)) for p in TOOLS.rglob("*") if p.is_file() and "__pycache__" not in p.parts
              and p.suffix not in (".py", ".sh") and p.name != "README.md"]
    assert not wrong and not others, (wrong, others)


def _help_in_process(path) -> tuple[int, str]:
    """(exit status, stdout) of ``python PATH --help``, run here (:func:`_in_process`)."""
    code, out = _in_process(path, "--help")
    return (0 if "usage:" in out else "returned without exiting") if code is None else code, out  # --help must end it


def _in_process(path, *args: str) -> tuple[int | None, str]:
    """(exit status, None where it returned without exiting; stdout) of ``python PATH ARGS``, run here; sys.path,
    sys.argv, torch's thread count and the modules it imported from tools/ are put back."""
    import torch

    path_before, argv_before, modules_before = list(sys.path), sys.argv, set(sys.modules)
    threads = torch.get_num_threads()
    out = io.StringIO()
    sys.path.insert(0, str(path.parent))
    sys.argv = [str(path), *args]
    code = None
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
    finally:
        sys.path[:], sys.argv = path_before, argv_before
        torch.set_num_threads(threads)
        for name in set(sys.modules) - modules_before:
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(TOOLS)):
                del sys.modules[name]
    return code, out.getvalue()


@pytest.mark.parametrize("script, args, says", [
    ("bench/compare_ops.py", ("--prefix-tokens", "32", "--continuations", "2", "--cont-tokens", "4:6", "--no-profile"),
     ("pack's speedup / position ratio: vs standalone",)),
    ("bench/profile_pack.py", ("--prefix-tokens", "32", "--continuations", "4", "--cont-tokens", "4:6", "--groups",
                               "2"), ("pack forward + backward (2 groups)", "| total (under the profiler) |")),
])
def test_the_bench_tools_on_packtrains_step_run_at_a_tiny_shape(script, args, says):
    """The two profilers that build the bench's workload from packtrain's own setup (``open_session``, the variants'
    plans, :func:`packtrain.bench.variants.one_pack_workload`) run to their tables; both had fallen behind that
    setup's API and failed at their start."""
    code, out = _in_process(TOOLS / script, *args)
    assert code is None and all(s in out for s in says), out[-2000:]


@pytest.mark.parametrize("script", _scripts())
def test_help(script):
    path = TOOLS / script
    if path.suffix == ".py":
        code, out = _help_in_process(path)
        assert code == 0 and "usage:" in out, (code, out[-2000:])
    else:
        proc = subprocess.run(["bash", str(path), "--help"], capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stdout + proc.stderr


def _private_imports(source: str) -> list[str]:
    """``from packtrain... import _name`` and ``packtrain.x._name`` attribute reads in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "packtrain":
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            found += [node.module] if any(part.startswith("_") for part in node.module.split(".")) else []
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "packtrain"
                      and any(part.startswith("_") for part in a.name.split("."))]
    return found


def test_no_tool_imports_a_private_name_of_packtrain():
    found = {s: _private_imports((TOOLS / s).read_text()) for s in _scripts() if s.endswith(".py")}
    assert not {s: names for s, names in found.items() if names}


def test_the_private_import_check_sees_one():
    source = "from packtrain.memory.measure import phase_hooks, _hidden\nimport packtrain._secret\n"
    assert _private_imports(source) == ["packtrain.memory.measure._hidden", "packtrain._secret"]


def test_the_readme_lists_every_script():
    readme = (TOOLS / "README.md").read_text()
    assert [s for s in _scripts() if f"`{s}`" not in readme] == []


def _node_ids():
    spec = importlib.util.spec_from_file_location("node_ids", TOOLS / "experiments" / "node_ids.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_node_ids_maps_moved_files_and_ids_and_names_the_lost(tmp_path):
    """tools/experiments/node_ids.py on a literal table: a kept id, a moved file, a renamed id, one whose file moved
    where it was not collected (lost, naming its target) and one no move names (lost)."""
    node_ids = _node_ids()
    moves = tmp_path / "moves.txt"
    moves.write_text("# a comment\ntests/a/test_x.py -> tests/b/test_x.py\n"
                     "tests/test_y.py::test_old[1] -> tests/test_z.py::test_new[1]\n")
    files, ids = node_ids.read_moves(moves)
    before = ["tests/test_k.py::test_k", "tests/a/test_x.py::test_1", "tests/a/test_x.py::test_2",
              "tests/test_y.py::test_old[1]", "tests/test_y.py::test_gone"]
    after = ["tests/test_k.py::test_k", "tests/b/test_x.py::test_1", "tests/test_z.py::test_new[1]",
             "tests/test_new.py::test_n"]
    result = node_ids.compare(before, after, files, ids)
    assert result == {"kept": ["tests/test_k.py::test_k"],
                      "moved": [("tests/a/test_x.py::test_1", "tests/b/test_x.py::test_1"),
                                ("tests/test_y.py::test_old[1]", "tests/test_z.py::test_new[1]")],
                      "lost": [("tests/a/test_x.py::test_2", "tests/b/test_x.py::test_2"),
                               ("tests/test_y.py::test_gone", None)],
                      "added": ["tests/test_new.py::test_n"]}


def test_node_ids_follows_moves_in_turn_and_bare_names_of_parametrized_tests(tmp_path):
    """A file moved, then one of its tests moved out of it by its bare name (every parameter goes along)."""
    node_ids = _node_ids()
    moves = tmp_path / "moves.txt"
    moves.write_text("tests/a/test_x.py -> tests/b/test_x.py\n"
                     "tests/b/test_x.py::test_p -> tests/c/test_p.py::test_p\n")
    files, ids = node_ids.read_moves(moves)
    before = ["tests/a/test_x.py::test_p[1]", "tests/a/test_x.py::test_p[2]", "tests/a/test_x.py::test_q"]
    after = ["tests/c/test_p.py::test_p[1]", "tests/c/test_p.py::test_p[2]", "tests/b/test_x.py::test_q"]
    result = node_ids.compare(before, after, files, ids)
    assert result["lost"] == [] and result["added"] == []
    assert [t for _, t in result["moved"]] == after


def test_node_ids_maps_a_test_to_its_own_first_parameter(tmp_path):
    """A test parametrized in place (`test_r -> test_r[a]`): moved, and the mapping ends (it looped, growing)."""
    node_ids = _node_ids()
    moves = tmp_path / "moves.txt"
    moves.write_text("tests/test_r.py::test_r -> tests/test_r.py::test_r[a]\n")
    after = ["tests/test_r.py::test_r[a]", "tests/test_r.py::test_r[b]"]
    result = node_ids.compare(["tests/test_r.py::test_r"], after, *node_ids.read_moves(moves))
    assert result["moved"] == [("tests/test_r.py::test_r", "tests/test_r.py::test_r[a]")] and not result["lost"]
    assert node_ids.moved_to("tests/test_r.py::test_r[b]", *node_ids.read_moves(moves)) is None


def test_node_ids_refuses_a_move_of_a_file_to_an_id(tmp_path):
    moves = tmp_path / "moves.txt"
    moves.write_text("tests/a/test_x.py -> tests/b/test_x.py::test_1\n")
    with pytest.raises(SystemExit, match=r"moves.txt:1: expected 'OLD -> NEW', both files or both node ids"):
        _node_ids().read_moves(moves)


def test_the_moves_of_docs_moved_tests_name_files_that_exist():
    """Every move's target file is collected today (a later move of the same file updates its line)."""
    files, ids = _node_ids().read_moves(REPO / "docs" / "moved_tests.txt")
    targets = set(files.values()) | {new.partition("::")[0] for new in ids.values()}
    assert [t for t in sorted(targets) if not (REPO / t).is_file()] == []
