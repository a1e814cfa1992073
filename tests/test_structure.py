"""The package's structure: dependencies run one way, no module imports in a cycle (lazy imports included), one
place decides and runs a unit's kind (the unit kinds, packtrain/run/units.py) and one what the gradient does with P
(the context strategies, packtrain/packed/context.py), counted, and tests/ mirrors the package."""

import ast
import collections
import functools
from pathlib import Path

import pytest

import packtrain

ROOT = Path(packtrain.__file__).parent
# A package (or top-level module) imports only those before it: the packed computation never imports the run.
# The package itself (packtrain/__init__.py: the public helpers, lazily) comes last, as the CLI does.
ORDER = ["versions", "exits", "faults", "config", "distributed", "data", "packed", "models", "memory", "rundir", "ops", "run", "bench", "commands",
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


# The homes of the decisions: the unit kinds (packtrain/run/units.py: what a unit is, how its packs are planned and
# run) and the context strategies (packtrain/packed/context.py: what the gradient does with P). Outside them a branch
# on a packing mode, a bench variant or a context mode by its name, or on a kind flag the data carries, is counted
# (config.py's validation included: it is the schema's, and its rules count like any other code's).
HOMES = {"packtrain.run.units", "packtrain.packed.context"}
MAX_BRANCHES = 8
PACKING_MODES = {"shared_prefix", "standalone", "tree"}
CONTEXT_NAMES = {"full", "kv_only", "frozen"}
VARIANT_NAMES = {"plain"}  # the bench's other variants are named after packing and context modes
NAMED = PACKING_MODES | CONTEXT_NAMES | VARIANT_NAMES
FLAGS = {"tree", "packed"}  # a kind carried by the data: plan.tree, layout.packed
NONE_FLAGS = {"pairs", "walk", "schedule", "walk_spec"}  # pack.pairs is None, pack.walk is None, ...
FLAG_KEYWORDS = {"packed", "tree", "items_only"}  # build(..., packed=False)
# what a unit runs on, besides the calls of the root: no code outside the kinds asks which one it holds
WORK_TYPES = {"Groups", "PackLayout", "Rows", "PackPass"}
# Where a unit's dummy (a flag of the equal-call rule, not a kind) may be asked: the kinds, and the walk's own calls
# (a dummy walk runs position 0 alone with its slot's calls).
DUMMY_HOMES = HOMES | {"packtrain.packed.walk"}


def _name(node) -> str | None:
    return getattr(node, "attr", getattr(node, "id", None))


def _strings(node) -> set[str]:
    """The string constants of a constant or a literal tuple, list or set of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*map(_strings, node.elts)) if node.elts else set()
    return {node.value} if isinstance(node, ast.Constant) and isinstance(node.value, str) else set()


def _tests(tree: ast.AST) -> list[ast.AST]:
    """The expressions a module branches on: if, while, assert and conditional tests, and/or operands and
    comprehension conditions."""
    tests = [n.test for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.While, ast.Assert))]
    tests += [v for n in ast.walk(tree) if isinstance(n, ast.BoolOp) for v in n.values]
    return tests + [c for n in ast.walk(tree) if isinstance(n, ast.comprehension) for c in n.ifs]


def branch_sites(tree: ast.AST) -> list[tuple[int, str]]:
    """The places in a module's tree that branch on a mode, variant or context name, or on a kind flag carried by
    the data: (line, what)."""
    sites = [(line, "isinstance on a call or work type") for line in _type_checks(tree, _call_types() | WORK_TYPES)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = {_name(x) for x in sides}
            named = set().union(*map(_strings, sides)) & NAMED
            none = any(isinstance(x, ast.Constant) and x.value is None for x in sides)
            if named:
                sites.append((node.lineno, f"{sorted(named)[0]!r} compared"))
            elif none and names & NONE_FLAGS and any(isinstance(x, ast.Attribute) for x in sides):
                sites.append((node.lineno, f".{sorted(names & NONE_FLAGS)[0]} is None?"))
            elif names & {"n_groups", "continuation_groups"} and any(isinstance(x, ast.Constant) for x in sides):
                sites.append((node.lineno, "is it in groups?"))
            elif any(isinstance(x, ast.Attribute) and x.attr == "name" and _name(x.value) == "context" for x in sides):
                sites.append((node.lineno, "a context mode by its name"))
        if isinstance(node, ast.keyword) and node.arg in FLAG_KEYWORDS:
            sites.append((node.value.lineno, f"{node.arg}= flag"))
    for test in _tests(tree):
        for node in ast.walk(test):
            if isinstance(node, ast.Attribute) and node.attr in FLAGS:
                sites.append((node.lineno, f".{node.attr} flag"))
    return sorted(set(sites))


def dummy_sites(tree: ast.AST) -> list[int]:
    """The lines that ask whether a unit is a dummy."""
    return sorted({node.lineno for test in _tests(tree) for node in ast.walk(test)
                   if isinstance(node, ast.Attribute) and node.attr == "dummy"})


def _branches_outside_the_homes() -> list[str]:
    """One entry per line (a branch with two of the patterns is one branch)."""
    lines = {}
    for mod, path in sorted(_modules().items()):
        if mod not in HOMES:
            for line, what in branch_sites(ast.parse(path.read_text())):
                lines.setdefault(f"{path.relative_to(ROOT.parent)}:{line}", what)
    return [f"{where}: {what}" for where, what in lines.items()]


def test_only_the_kinds_decide_a_units_kind():
    """Outside the unit kinds (packtrain/run/units.py) and the context strategies (packtrain/packed/context.py), at
    most MAX_BRANCHES branches on a packing mode, a variant or a context mode by name, or on a kind flag the data
    carries (plan.tree, pack.pairs is None, pack.walk is None, layout.packed, packed=False), and no isinstance on a
    call or work type; a unit's dummy is asked only by the kinds and the walk."""
    found = _branches_outside_the_homes()
    assert len(found) <= MAX_BRANCHES, f"{len(found)} branches outside the homes:\n" + "\n".join(found)
    dummies = [f"{path.relative_to(ROOT.parent)}:{line}" for mod, path in _modules().items()
               if mod not in DUMMY_HOMES for line in dummy_sites(ast.parse(path.read_text()))]
    assert not dummies, f"a unit's dummy asked outside the kinds: {dummies}"


def test_the_kind_check_sees_every_kind_of_site():
    source = """
if unit.schedule is None: pass
grouped = cfg.packing.continuation_groups > 1
packed = kinds.mode == "shared_prefix"
kept = [u for u in units if not u.dummy]
layout = unit_layout(unit, plan, examples, items_only=True)
if isinstance(work, Groups): pass
ok = lm.context.name == "frozen" and unit.kind is WALK
tree = plan.tree and pack.pairs is None
alone = build(unit, plan, examples, packed=False) if not layout.packed else None
plain = variant in ("plain", "standalone")
same = lm.context.name == other
"""
    assert [what for _, what in branch_sites(ast.parse(source))] == [
        ".schedule is None?", "is it in groups?", "'shared_prefix' compared", "items_only= flag",
        "isinstance on a call or work type", "'frozen' compared", ".pairs is None?", ".tree flag", ".packed flag",
        "packed= flag", "'plain' compared", "a context mode by its name"]
    assert dummy_sites(ast.parse(source)) == [5]


def test_the_branch_counter_fails_on_a_planted_branch(tmp_path, monkeypatch):
    """The count above can fail: the package's own modules with one more branch planted in a copy of
    packtrain/run/step.py (outside the homes) beyond the budget, and each planted kind of branch is one more."""
    found = _branches_outside_the_homes()
    planted = ["if plan.tree: pass", "if pack.pairs is None: pass", "ok = kinds.mode != 'standalone'",
               "x = lm.context.name == 'kv_only'", "if layout.packed: pass", "y = build(u, p, e, packed=False)"]
    pkg = tmp_path / "packtrain"
    for path in ROOT.rglob("*.py"):
        (pkg / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        (pkg / path.relative_to(ROOT)).write_text(path.read_text())
    steps = pkg / "run" / "step.py"
    n = max(MAX_BRANCHES + 1 - len(found), len(planted))  # past the budget, every kind of branch at least once
    steps.write_text(steps.read_text() + "\n" + "\n".join((planted * n)[:n]) + "\n")
    monkeypatch.setattr(packtrain, "__file__", str(pkg / "__init__.py"))
    monkeypatch.setitem(globals(), "ROOT", pkg)
    assert len(_branches_outside_the_homes()) == len(found) + n
    with pytest.raises(AssertionError, match="branches outside the homes"):
        test_only_the_kinds_decide_a_units_kind()


@functools.cache
def _call_types() -> frozenset[str]:
    """The calls of packtrain.packed.lm.PackedLM: the classes of packtrain/packed that define ``run``, and their
    subclasses there (StandaloneCall, TreeCall: a PackCall's run on another forward)."""
    classes = [node for path in (ROOT / "packed").rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef)]
    calls = {c.name for c in classes if any(isinstance(f, ast.FunctionDef) and f.name == "run" for f in c.body)}
    while True:
        more = {c.name for c in classes if any(_name(b) in calls for b in c.bases)} - calls
        if not more:
            return frozenset(calls)
        calls |= more


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
    assert {"PackCall", "StandaloneCall", "TreeCall", "GroupCall", "PrefixCall", "Window", "ItemsCall",
            "DecodeCall"} <= calls
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


# One run setup (packtrain/run/session.py): the splits, the plan, the savings, the model, the kinds and the task are
# made there for every command; a call of one of these anywhere else is a second setup. Each function's own module
# may call it (a definition, its helpers).
SETUP_CALLS = {"load_split": "packtrain.data.jsonl", "plan_for": "packtrain.run.units",
               "choose_savings": "packtrain.run.units", "image_loader": "packtrain.run.units",
               "build_base_model": "packtrain.models.build", "assemble": "packtrain.models.wrap",
               "task_for": "packtrain.run.task", "task_start": "packtrain.run.session", "Kinds.of": "packtrain.run.units",
               "Kinds.named": "packtrain.run.units"}
SETUP_HOME = "packtrain.run.session"


def setup_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every call of :data:`SETUP_CALLS` in ``tree`` (``f(...)``, ``module.f(...)``, ``Kinds.of(...)``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f"{f.value.id}.{f.attr}" in SETUP_CALLS:
            name = f"{f.value.id}.{f.attr}"
        if name in SETUP_CALLS:
            found.append((node.lineno, name))
    return found


def _setups_outside_the_session(modules: dict[str, Path]) -> list[str]:
    return [f"{mod}:{line} calls {name}" for mod, path in sorted(modules.items()) if mod != SETUP_HOME
            for line, name in setup_calls(ast.parse(path.read_text())) if SETUP_CALLS[name] != mod]


def test_one_run_setup_for_every_command():
    assert not _setups_outside_the_session(_modules())


def test_the_setup_check_fails_on_a_planted_second_setup(tmp_path):
    """A command that plans or assembles on its own is seen."""
    planted = tmp_path / "planted.py"
    planted.write_text("from packtrain.run.units import Kinds, plan_for\nfrom packtrain.models import wrap\n"
                       "def run(cfg, ex, base):\n    plan = plan_for(cfg, ex)\n"
                       "    return wrap.assemble(base, cfg, 'cpu'), Kinds.of(cfg)\n")
    assert _setups_outside_the_session({"packtrain.commands.planted": planted}) == [
        "packtrain.commands.planted:4 calls plan_for", "packtrain.commands.planted:5 calls assemble",
        "packtrain.commands.planted:5 calls Kinds.of"]


# The kernel back end is chosen once (packtrain/packed/kernels/__init__.py names it) and its functions picked once
# (packtrain/packed/patch.py): nothing else reads a back end's names or compares them.
BACKEND_HOMES = {"packtrain.packed.kernels", "packtrain.packed.patch"}
BACKEND_NAMES = {"torch", "fla", "batched", "dense", "flex"}


def backend_dispatch(tree: ast.AST) -> list[int]:
    """Lines that read a back end's kernel names (``backend.gdn``, ``x.packtrain_backend.attention``) or compare a
    back end's value (or a ``kind`` taken from it) with one of them."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("gdn", "attention", "gdn_kernel") \
                and "backend" in ast.unparse(node.value):
            found.add(node.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = [c for c in sides if isinstance(c, ast.Constant) and c.value in BACKEND_NAMES]
            others = [ast.unparse(c) for c in sides if not isinstance(c, ast.Constant)]
            if names and any("backend" in o or o == "kind" for o in others):
                found.add(node.lineno)
    return sorted(found)


def _dispatch_outside_the_homes(modules: dict[str, Path]) -> list[str]:
    return [f"{mod}:{line}" for mod, path in sorted(modules.items()) if mod not in BACKEND_HOMES
            for line in backend_dispatch(ast.parse(path.read_text()))]


def test_the_back_end_is_picked_once_not_dispatched_by_name():
    assert not _dispatch_outside_the_homes(_modules())


def test_the_dispatch_check_fails_on_a_planted_string_dispatch(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def conv(module, x, backend):\n    if backend.gdn == 'fla':\n        return 1\n"
                       "    kind = module.packtrain_backend.attention\n    if kind == 'dense':\n        return 2\n"
                       "    state = module.prefix.gdn\n    return 3\n")
    assert _dispatch_outside_the_homes({"packtrain.packed.gdn": planted}) == [
        "packtrain.packed.gdn:2", "packtrain.packed.gdn:4", "packtrain.packed.gdn:5"]


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
# module's at tests/test_<module>.py): every module but __main__ (test_every_module_is_tested_or_named_why).
TESTED_MODULES = [
    "bench/presets", "bench/report", "bench/timing", "bench/variants", "cli", "commands/bench", "commands/check_nodes",
    "commands/dump_stacks", "commands/eval", "commands/export", "commands/plan", "commands/pretune_fla",
    "commands/smoke", "commands/train", "config", "config/support", "config/templates", "config/tiles", "config/typed",
    "data/attention_pairs", "data/chat", "data/example", "data/images", "data/jsonl", "data/planner", "data/preference",
    "data/prefix_tree", "data/scored", "data/tree_packs", "data/walk_calls", "distributed", "exits", "faults", "memory/budget",
    "memory/describe", "memory/estimate", "memory/fla_shapes", "memory/flex_shapes", "memory/measure", "memory/savings",
    "memory/step_time", "models/build", "models/cost", "models/exports", "models/loading", "models/lora_compute",
    "models/offload", "models/parameters", "models/serving", "models/start_adapter", "models/text_config",
    "models/wrap", "ops/fla_tune", "ops/nodes", "ops/runtime", "ops/wandb_mirror", "ops/watchdog", "packed/attention",
    "packed/context", "packed/cut", "packed/decode", "packed/equal", "packed/families", "packed/gather", "packed/gdn",
    "packed/groups", "packed/kernels/fla_backend", "packed/kernels/fla_frozen", "packed/kernels/flex",
    "packed/kernels/hf_route", "packed/kernels/interpreter", "packed/kernels/torch_ref", "packed/layout", "packed/lm",
    "packed/loss", "packed/pack_pass", "packed/patch", "packed/prefix", "packed/recompute", "packed/rng", "packed/rows",
    "packed/rowsparse", "packed/tree", "packed/walk", "run/balance", "run/cadence", "run/eval_figures", "run/evaluate",
    "run/finite", "run/generate", "run/harness", "run/header", "run/metrics", "run/objective", "run/optim",
    "run/progress", "run/reference", "run/rl", "run/rollouts", "run/scoring", "run/session", "run/signals", "run/step",
    "run/task", "run/trainer", "run/units", "rundir/checkpoint", "rundir/directory", "rundir/disk", "rundir/overrides", "rundir/resume",
    "rundir/tokenizer", "versions",
]


def missing_test_files(modules: list[str], tests: Path, package: Path) -> list[str]:
    """The modules of ``modules`` (paths under ``package`` without .py) that are gone, or have no test file of
    their own name under ``tests``."""
    wrong = [f"packtrain/{m}.py does not exist" for m in modules
             if not ((package / f"{m}.py").is_file() or (package / m / "__init__.py").is_file())]  # or a package
    return wrong + [f"packtrain/{m}.py has no tests/{Path(m).parent / f'test_{Path(m).name}.py'}"
                    for m in modules if not (tests / Path(m).parent / f"test_{Path(m).name}.py").is_file()]


def test_every_listed_module_has_its_own_test_file():
    assert not missing_test_files(TESTED_MODULES, Path(__file__).resolve().parent, ROOT)


# Modules without logic of their own to test: the entry point that calls cli.main
UNTESTED = {"__main__": "calls packtrain.cli.main (tests/test_cli.py)"}


def test_every_module_is_tested_or_named_why():
    modules = {str(p.relative_to(ROOT).with_suffix("")) for p in ROOT.rglob("*.py") if p.name != "__init__.py"}
    modules |= {"config"}  # packtrain/config/__init__.py: the config schema and its rules
    assert modules - set(TESTED_MODULES) - set(UNTESTED) == set()
    assert set(TESTED_MODULES) | set(UNTESTED) <= modules


def test_the_test_file_check_sees_a_missing_file_and_a_gone_module(tmp_path):
    for name in ("packtrain/run/step.py", "packtrain/run/units.py", "packtrain/config.py", "tests/run/test_units.py",
                 "tests/test_config.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    modules = ["run/step", "run/units", "config", "run/gone"]
    assert missing_test_files(modules, tmp_path / "tests", tmp_path / "packtrain") == [
        "packtrain/run/gone.py does not exist", "packtrain/run/step.py has no tests/run/test_step.py",
        "packtrain/run/gone.py has no tests/run/test_gone.py"]
