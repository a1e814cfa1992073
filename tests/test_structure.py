"""The package's structure: dependencies run one way, no module imports in a cycle (lazy imports included), one
place decides and runs a unit's kind (the unit kinds, packtrain/run/units.py), and tests/ mirrors the package."""

import ast
import collections
import functools
from pathlib import Path

import packtrain

ROOT = Path(packtrain.__file__).parent
# A package (or top-level module) imports only those before it: the packed computation never imports the run.
# The package itself (packtrain/__init__.py: the public helpers, lazily) comes last, as the CLI does.
ORDER = ["versions", "exits", "faults", "config", "distributed", "data", "packed", "models", "rundir", "ops", "run", "bench", "commands",
         "cli", "__main__", "__init__"]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("packtrain",) + path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Every packtrain module each module imports, at module level or inside a function."""
    def resolve(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges = collections.defaultdict(set)
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: relative import")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "packtrain":
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges[mod].add(full if full in modules else resolve(node.module))
            elif isinstance(node, ast.Import):
                edges[mod] |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "packtrain"}
        edges[mod].discard(mod)
    return edges


def _part(mod: str) -> str:
    return mod.split(".")[1] if "." in mod else "__init__"


def test_every_module_belongs_to_a_known_part():
    unknown = sorted({_part(m) for m in _modules()} - set(ORDER) - {"__init__"})
    assert not unknown, f"add {unknown} to ORDER in tests/test_structure.py"


def test_dependencies_run_one_way():
    wrong = []
    for mod, deps in _imports(_modules()).items():
        for dep in deps:
            a, b = _part(mod), _part(dep)
            if a != b and b != "__init__" and ORDER.index(b) > ORDER.index(a):
                wrong.append(f"{mod} imports {dep}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    edges = _imports(_modules())
    state, cycles = {}, []

    def visit(mod, path):
        state[mod] = "open"
        for dep in sorted(edges[mod]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [mod, dep]) if dep in path else f"{mod} -> {dep}")
            elif dep not in state:
                visit(dep, path + [mod])
        state[mod] = "done"

    for mod in sorted(edges):
        if mod not in state:
            visit(mod, [])
    assert not cycles, "\n".join(cycles)


def test_the_checks_see_a_cycle_and_a_wrong_way_import(tmp_path, monkeypatch):
    """The two checks above can fail: a package where a imports b, b imports a lazily, and packed imports run."""
    pkg = tmp_path / "packtrain"
    (pkg / "packed").mkdir(parents=True)
    (pkg / "run").mkdir()
    for init in (pkg, pkg / "packed", pkg / "run"):
        (init / "__init__.py").write_text("")
    (pkg / "packed" / "a.py").write_text("from packtrain.run.b import x\n")
    (pkg / "run" / "b.py").write_text("def f():\n    from packtrain.packed import a\n")
    monkeypatch.setattr(packtrain, "__file__", str(pkg / "__init__.py"))
    monkeypatch.setitem(globals(), "ROOT", pkg)
    edges = _imports(_modules())
    assert edges["packtrain.packed.a"] == {"packtrain.run.b"} and edges["packtrain.run.b"] == {"packtrain.packed.a"}
    try:
        test_dependencies_run_one_way()
    except AssertionError as e:
        assert "packtrain.packed.a imports packtrain.run.b" in str(e)
    else:
        raise AssertionError("the wrong-way import was not seen")
    try:
        test_no_import_cycles()
    except AssertionError as e:
        assert "packtrain.packed.a" in str(e) and "packtrain.run.b" in str(e)
    else:
        raise AssertionError("the cycle was not seen")


# Where a unit's kind may be decided: the kinds themselves (packtrain/run/units.py) and the walk's and the groups'
# own code (a walk's dummy, a group's weight). config.py validates a config's values, the planner makes the packs.
KIND_HOMES = {"packtrain.run.units", "packtrain.packed.walk", "packtrain.packed.groups", "packtrain.config",
              "packtrain.data.planner"}
PACKING_MODES = {"shared_prefix", "standalone", "tree"}
# what a unit runs on, besides the calls of the root: no code outside the kinds asks which one it holds
WORK_TYPES = {"Groups", "PackLayout", "Rows", "PackPass"}


def _name(node) -> str | None:
    return getattr(node, "attr", getattr(node, "id", None))


def kind_sites(tree: ast.AST) -> list[tuple[int, str]]:
    """The places in a module's tree that decide which kind a unit is: (line, what)."""
    sites = [(line, "isinstance on a call or work type") for line in _type_checks(tree, _call_types() | WORK_TYPES)]
    tests = [n.test for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.While, ast.Assert))]
    tests += [v for n in ast.walk(tree) if isinstance(n, ast.BoolOp) for v in n.values]
    tests += [c for n in ast.walk(tree) if isinstance(n, ast.comprehension) for c in n.ifs]
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = {_name(x) for x in sides}
            none = any(isinstance(x, ast.Constant) and x.value is None for x in sides)
            modes = {x.value for x in sides if isinstance(x, ast.Constant)} & PACKING_MODES
            if none and names & {"schedule", "walk"} and any(isinstance(x, ast.Attribute) for x in sides):
                sites.append((node.lineno, "is it walked?"))
            if names & {"n_groups", "continuation_groups"}:
                sites.append((node.lineno, "is it in groups?"))
            if modes and names & {"mode"}:
                sites.append((node.lineno, f"packing mode {sorted(modes)[0]}?"))
        if isinstance(node, (ast.Name, ast.keyword, ast.arg)) and (node.id if isinstance(node, ast.Name) else
                                                                   node.arg) == "items_only":
            sites.append((getattr(node, "lineno", 0), "items only?"))
    for test in tests:
        for node in ast.walk(test):
            if isinstance(node, ast.Attribute) and node.attr == "dummy":
                sites.append((node.lineno, "is it a dummy?"))
    return sorted(set(sites))


def test_only_the_kinds_decide_a_units_kind():
    """Nothing outside the unit kinds (packtrain/run/units.py) asks what kind a unit is: not whether it is walked, in
    groups, a dummy, a generation's items or of which packing mode, nor which call or work type it holds."""
    found = [f"{path.relative_to(ROOT.parent)}:{line}: {what}" for mod, path in _modules().items()
             if mod not in KIND_HOMES for line, what in kind_sites(ast.parse(path.read_text()))]
    assert not found, "\n".join(found)


def test_the_kind_check_sees_every_kind_of_site():
    source = """
if unit.schedule is None: pass
grouped = cfg.packing.continuation_groups > 1
packed = setup.mode == "shared_prefix"
kept = [u for u in units if not u.dummy]
layout = unit_layout(unit, plan, examples, items_only=True)
if isinstance(work, Groups): pass
ok = lm.context.name == "frozen" and unit.kind is WALK
"""
    assert [what for _, what in kind_sites(ast.parse(source))] == [
        "is it walked?", "is it in groups?", "packing mode shared_prefix?", "is it a dummy?", "items only?",
        "isinstance on a call or work type"]


@functools.cache
def _call_types() -> frozenset[str]:
    """The calls of packtrain.packed.lm.PackedLM: the classes of packtrain/packed that define ``run``."""
    return frozenset(node.name for path in (ROOT / "packed").rglob("*.py")
                     for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                     and any(isinstance(f, ast.FunctionDef) and f.name == "run" for f in node.body))


def _type_checks(tree: ast.AST, names: set[str]) -> list[int]:
    """The lines of ``isinstance`` calls whose second argument names one of ``names``."""
    return sorted(node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2
            and any(getattr(a, "id", getattr(a, "attr", None)) in names for a in ast.walk(node.args[1])))


# What a packed forward passes under the layout kwarg: the patched layers call its methods, never ask its type.
_UNDER_THE_LAYOUT_KWARG = {"PackPass", "Rows", "PackLayout"}


def test_calls_and_layer_inputs_run_by_method_not_by_type():
    """PackedLM.forward is ``call.run(self)``: no isinstance on a call type (or a layout) in packed/lm.py; the
    attention function and the GDN forward dispatch by method on what they get under the layout kwarg."""
    calls = _call_types()
    assert {"PackCall", "GroupCall", "PrefixCall", "Window", "ItemsCall", "DecodeCall"} <= calls
    found = {f"packed/lm.py:{n}" for n in _type_checks(ast.parse((ROOT / "packed" / "lm.py").read_text()),
                                                       calls | {"PackLayout"})}
    for name in ("patch.py", "attention.py"):
        found |= {f"packed/{name}:{n}"
                  for n in _type_checks(ast.parse((ROOT / "packed" / name).read_text()), _UNDER_THE_LAYOUT_KWARG)}
    assert not found, f"isinstance on a call type or a layer input at {sorted(found)}"


def test_the_type_check_sees_an_isinstance_on_a_call():
    """The check above can fail: a forward that asks a call's type, alone or in a tuple, by name or attribute."""
    source = ("def forward(self, call):\n"
              "    if isinstance(call, (walk.Window, PrefixCall)):\n"
              "        return 1\n"
              "    return isinstance(call, int) or isinstance(call, DecodeCall)\n")
    assert _type_checks(ast.parse(source), _call_types()) == [2, 4]


def test_the_design_map_lists_every_module():
    design = (ROOT.parent / "docs" / "design.md").read_text()
    missing = [f"packtrain/{p.relative_to(ROOT)}" for p in sorted(ROOT.rglob("*.py"))
               if p.name != "__init__.py" and f"`packtrain/{p.relative_to(ROOT)}`" not in design]
    assert not missing, f"docs/design.md's map does not list {missing}"


def tree_mismatches(tests: Path, package: Path) -> list[str]:
    """Where ``tests`` does not mirror ``package``: a folder that is no subpackage of it (tests/packed/kernels holds
    the tests of packtrain/packed/kernels; the root those of the top-level modules and the helpers), or a test file's
    name in two folders (with no __init__.py, pytest imports a test file by its name alone)."""
    wrong = [f"tests/{d.relative_to(tests)}/ is no packtrain subpackage" for d in sorted(tests.rglob("*"))
             if d.is_dir() and "__pycache__" not in d.parts
             and not (package / d.relative_to(tests) / "__init__.py").is_file()]
    names = collections.Counter(path.name for path in tests.rglob("test_*.py"))
    return wrong + [f"{name} is in {n} folders" for name, n in sorted(names.items()) if n > 1]


def test_the_tests_mirror_the_package():
    assert not tree_mismatches(Path(__file__).resolve().parent, ROOT)


def test_the_mirror_check_sees_a_stray_folder_and_a_name_twice(tmp_path):
    """The check above can fail: tests/nonsense/ has no packtrain/nonsense, and test_a.py is in two folders."""
    for folder in ("packtrain", "packtrain/packed", "packtrain/packed/kernels"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    for name in ("nonsense/test_a.py", "packed/test_a.py", "packed/kernels/test_b.py", "__pycache__/x.pyc"):
        (tmp_path / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / name).write_text("")
    assert tree_mismatches(tmp_path / "tests", tmp_path / "packtrain") == [
        "tests/nonsense/ is no packtrain subpackage", "test_a.py is in 2 folders"]


# Modules that hold logic, each with a test file of its own name (tests/<package>/test_<module>.py; a top-level
# module's at tests/test_<module>.py). A module joins the list with its file; the list grows until every module that
# holds logic is on it.
TESTED_MODULES = [
    "commands/export", "commands/plan", "commands/smoke", "commands/train", "config", "data/chat", "data/examples",
    "data/images", "data/planner", "distributed", "models/loading", "models/lora_compute", "models/memory",
    "models/offload", "models/savings", "ops/fla_tune", "ops/nodes", "ops/runtime", "ops/watchdog", "packed/attention",
    "packed/cut", "packed/equal", "packed/families", "packed/gdn", "packed/groups", "packed/kernels/torch_ref",
    "packed/layout", "packed/loss", "packed/recompute", "packed/rng", "packed/rowsparse", "packed/tree", "packed/walk",
    "run/balance", "run/finite", "run/generate", "run/measure", "run/scoring", "run/signals", "run/trainer",
    "run/units", "rundir/checkpoint", "rundir/directory", "rundir/resume", "versions",
]


def missing_test_files(modules: list[str], tests: Path, package: Path) -> list[str]:
    """The modules of ``modules`` (paths under ``package`` without .py) that are gone, or have no test file of
    their own name under ``tests``."""
    wrong = [f"packtrain/{m}.py does not exist" for m in modules if not (package / f"{m}.py").is_file()]
    return wrong + [f"packtrain/{m}.py has no tests/{Path(m).parent / f'test_{Path(m).name}.py'}"
                    for m in modules if not (tests / Path(m).parent / f"test_{Path(m).name}.py").is_file()]


def test_every_listed_module_has_its_own_test_file():
    assert not missing_test_files(TESTED_MODULES, Path(__file__).resolve().parent, ROOT)


def test_the_test_file_check_sees_a_missing_file_and_a_gone_module(tmp_path):
    for name in ("packtrain/run/step.py", "packtrain/run/units.py", "packtrain/config.py", "tests/run/test_units.py",
                 "tests/test_config.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    modules = ["run/step", "run/units", "config", "run/gone"]
    assert missing_test_files(modules, tmp_path / "tests", tmp_path / "packtrain") == [
        "packtrain/run/gone.py does not exist", "packtrain/run/step.py has no tests/run/test_step.py",
        "packtrain/run/gone.py has no tests/run/test_gone.py"]
