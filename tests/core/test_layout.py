"""The layout keeps the architecture readable: short functions and classes in core/ and adapters/, no import cycle,
the test stand-ins reached by tests only, a demo that registers nothing on import, and the reading path of one
divergence that docs/how-it-works.md promises."""
import ast
import os
import pathlib
import re
import subprocess
import sys
from typing import Dict, List, Set

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "petr_stability"
MAX_FUNCTION = 60
MAX_CLASS = 300


def _modules() -> Dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, known: Set[str]) -> Set[str]:
    """The package modules ``name`` imports at module level (not inside functions: those run later)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.parse(path.read_text()).body:
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        found.update(t for t in targets if t in known and t != name)
    return found


def test_no_function_over_60_lines_and_no_class_over_300_in_core_and_adapters():
    long = []
    for path in sorted(list((PACKAGE / "core").rglob("*.py")) + list((PACKAGE / "adapters").rglob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}() {size} lines")
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} class {node.name} {size} lines")
    assert long == []


def test_no_import_cycle_in_the_package():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    # Tarjan's strongly connected components: any component of more than one module is a cycle.
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    cycles: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_test_stand_ins_are_imported_by_tests_only():
    modules = _modules()
    users = sorted(name for name, path in modules.items()
                   if not name.startswith("petr_stability.testing")
                   and any(m.startswith("petr_stability.testing") for m in _imports(name, path, set(modules))))
    function_level = sorted(str(p.relative_to(ROOT)) for name, p in modules.items()
                            if not name.startswith("petr_stability.testing") and "testing" in p.read_text()
                            and re.search(r"^\s+(from|import) (petr_stability\.|\.+)testing", p.read_text(), re.M))
    assert users == [] and function_level == []


def test_importing_the_demo_registers_nothing():
    code = """
import importlib, inspect, sys
import petr_stability  # the hooks register here, by design
mine = set()
for name in ("petr_stability.demo", "petr_stability.demo.model", "petr_stability.demo.data",
             "petr_stability.demo.amp", "petr_stability.demo.run"):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # demo.amp needs MMEngine's runner stack
        print("not importable here:", name, exc, file=sys.stderr)
        continue
    mine.update(n for n, obj in vars(module).items() if inspect.isclass(obj) and obj.__module__ == name)
registered = set()
for path, names in (("mmengine.registry", ("MODELS", "OPTIM_WRAPPERS", "HOOKS", "DATASETS")),
                    ("mmcv.cnn.bricks.registry", ("ATTENTION", "TRANSFORMER_LAYER"))):
    try:
        registry_module = importlib.import_module(path)
    except ImportError:
        continue
    for n in names:
        registered.update(getattr(registry_module, n).module_dict)
assert len(mine) >= 4, mine
assert not mine & registered, sorted(mine & registered)
print("ok", sorted(mine))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT),
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]


def test_how_it_works_lists_the_files_one_divergence_really_goes_through():
    from divergence_path import documented, trace_divergence

    listed = documented((ROOT / "docs" / "how-it-works.md").read_text())
    for path in listed:
        assert (ROOT / path).is_file(), path
    found, hops = trace_divergence()
    # The driven loop's own GuardIO stands where a runner's io.py stands (the doc names those beside the hook).
    on_path = set(found) - {"petr_stability/adapters/torch_loop.py"}
    assert sorted(listed - on_path) == [], "listed, but no longer on the path"
    assert sorted(on_path - listed) == [], "on the path, but not listed"
    assert len(found) <= 30 and hops <= 56, (len(found), hops)


def test_a_remedy_that_does_not_act_changes_nothing_on_the_divergence_path():
    # Issue 32: the path grew with every remedy (the registry called each one's state, summary and tags). A remedy
    # registered in a test file that takes events this divergence never fires is never entered.
    from divergence_path import trace_divergence

    from petr_stability.core.remedies import Remedy, When, register_remedy
    from petr_stability.core.remedies.registry import REMEDY_TYPES
    from petr_stability.core.validate import Setting, is_number

    class NeverActs(Remedy):
        name = "never_acts"
        events = (When.STALLED, When.SKIPPED)
        settings = (Setting("never_acts_factor", 0.5, is_number(), "a setting of its own."),)
        state = ("count",)
        tags = ("count",)
        idle = {"never_acts_count": 0}

        def __init__(self, config):
            super().__init__(config)
            self.count = 0

        def apply(self, ctx):
            self.count += 1
            return []

    before = trace_divergence()
    register_remedy(NeverActs)
    try:
        after = trace_divergence()
    finally:
        REMEDY_TYPES.pop(NeverActs.name)
    assert (len(after[0]), after[1]) == (len(before[0]), before[1]) and after[0] == before[0]


def _registry():
    from petr_stability.core.remedies.registry import remedy_types

    return remedy_types()


def test_every_remedy_has_its_file_its_tests_and_its_row_in_the_docs():
    import inspect

    from petr_stability.core.remedies.base import Remedy

    docs = (ROOT / "docs" / "remedies.md").read_text()
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py") if p.name != "test_layout.py")
    for remedy in _registry():
        path = pathlib.Path(inspect.getsourcefile(remedy))
        assert path.parent == PACKAGE / "core" / "remedies", (remedy, path)
        module = inspect.getmodule(remedy)
        own = [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, Remedy) and c is not Remedy
               and c.__module__ == module.__name__]
        assert own == [remedy], f"{path.name} holds {own}: one remedy per file"
        assert re.search(rf"\b{remedy.__name__}\b", tests), f"no test names {remedy.__name__}"
        rows = re.findall(rf"^\| `{remedy.name}` \|(.*)\|(.*)\|(.*)\|$", docs, re.M)
        assert len(rows) == 1, f"docs/remedies.md has no row for {remedy.name!r}"
        serves, events, state = (cell.strip() for cell in rows[0])
        assert [e.strip() for e in events.split(",") if e.strip()] == [e.value for e in remedy.events], (remedy.name,
                                                                                              events)
        for cause in remedy.causes:
            assert cause.value in serves, (remedy.name, serves)
        for cause in remedy.assists:
            assert f"assists {cause.value}" in serves, (remedy.name, serves)
        assert sorted(re.findall(r"`([\w.]+)`", state)) == sorted(remedy.state), remedy.name


def test_a_built_in_remedy_is_its_module_its_test_and_its_docs_row():
    # Issue 40: the registry finds the built-ins (one Remedy subclass per module of core/remedies/) and each declares
    # where it fires (`order`): no list of them to extend, no import of them in the registry.
    import inspect

    registry = PACKAGE / "core" / "remedies" / "registry.py"
    modules = _modules()
    imported = _imports("petr_stability.core.remedies.registry", registry, set(modules))
    assert sorted(m for m in imported if m.startswith("petr_stability.core.remedies.")) == [
        "petr_stability.core.remedies.base"]
    builtins = sorted(pathlib.Path(inspect.getsourcefile(r)).stem for r in _registry()
                      if pathlib.Path(inspect.getsourcefile(r)).parent == PACKAGE / "core" / "remedies")
    remedy_modules = sorted(p.stem for p in (PACKAGE / "core" / "remedies").glob("*.py")
                            if p.stem not in ("__init__", "base", "registry", "targets"))
    assert builtins == remedy_modules


def test_the_ladder_is_declared_once_and_nothing_else_lists_remedies():
    import dataclasses

    from petr_stability.core.causes import CauseRow
    from petr_stability.core.remedies.registry import LADDER, REMEDIES

    assert [f.name for f in dataclasses.fields(CauseRow) if "remed" in f.name] == []
    docs = (ROOT / "docs" / "remedies.md").read_text()
    for number, rung in enumerate(LADDER, 1):
        assert all(re.search(rf"^\| `{n}` \| [^|]*\(rung {number}\)", docs, re.M) for n in rung.remedies)
    names = set(REMEDIES)
    lists = []
    for path in sorted(p for part in ("core", "adapters", "configfix") for p in (PACKAGE / part).rglob("*.py")):
        if path.name == "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 and all(
                    isinstance(e, ast.Constant) and e.value in names for e in node.elts):
                lists.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert lists == []


def test_the_chain_and_the_policy_never_name_a_remedy():
    from petr_stability.core.remedies.registry import REMEDY_TYPES

    named = []
    for path in (PACKAGE / "core" / "recovery" / "chain.py", PACKAGE / "core" / "recovery" / "policy.py",
                 PACKAGE / "core" / "guard.py", PACKAGE / "adapters" / "driver.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in REMEDY_TYPES:
                named.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert named == []


def _keys_named(tree: ast.AST) -> List[tuple]:
    """String constants used as a state key: a subscript, ``.get/.pop/.setdefault``'s key, a dict literal's key."""
    found = []
    for node in ast.walk(tree):
        keys: List[ast.AST] = []
        if isinstance(node, ast.Subscript):
            keys = [node.slice.value if type(node.slice).__name__ == "Index" else node.slice]  # 3.8's ast.Index
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and \
                node.func.attr in ("get", "pop", "setdefault"):
            keys = [node.args[0]]
        elif isinstance(node, ast.Dict):
            keys = [k for k in node.keys if k is not None]
        found += [(k.value, node.lineno) for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return found


def test_no_file_but_its_own_names_a_remedys_state():
    import dataclasses
    import inspect

    from petr_stability.configfix.patch import ConfigFix

    owners = {key: pathlib.Path(inspect.getsourcefile(r)) for r in _registry() for key in r.state}
    # A config fix's own fields are the config patcher's vocabulary (a remedy carrying the same value may keep it
    # under the same name): named there, they are not a remedy's state.
    fields = {f.name for f in dataclasses.fields(ConfigFix)}
    patcher = PACKAGE / "configfix" / "patch.py"
    named = []
    # The machinery (the demo and the report read the summary and the records it writes: their public output).
    for path in sorted(p for part in ("core", "adapters", "configfix") for p in (PACKAGE / part).rglob("*.py")):
        for key, line in _keys_named(ast.parse(path.read_text())):
            if key in owners and owners[key] != path and not (path == patcher and key in fields):
                named.append(f"{path.relative_to(ROOT)}:{line} {key!r}")
    assert named == []


@pytest.mark.parametrize("module", ["petr_stability.core", "petr_stability.configfix"])
def test_framework_free_packages_import_without_mmengine_or_mmcv(module):
    code = f"""
import sys
for name in ("mmengine", "mmcv", "mmdet", "mmdet3d"):
    sys.modules[name] = None  # as if not installed: import fails, find_spec says None
import importlib, pkgutil
pkg = importlib.import_module({module!r})
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    importlib.import_module(info.name)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT),
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_no_module_outside_the_remedies_imports_the_quarantine_remedy():
    # Issue 40: the chain and the tracker reach the quarantine's bookkeeping (core/skiplist.py), never the remedy.
    importers = []
    for path in sorted((PACKAGE).rglob("*.py")):
        if path.parent == PACKAGE / "core" / "remedies":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("quarantine"):
                importers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert importers == []


def test_the_chain_reads_the_samples_verdict_by_its_fields_never_by_the_quarantines_keys():
    # Issue 40: what the quarantine did reaches the chain, the policy and the tracker as a typed SampleVerdict; its
    # keys are the record's schema (SampleVerdict.signals), written in one place and read here by nobody.
    keys = {"quarantined", "refused", "recurring", "bad_data", "stored", "reason"}

    def on_signals(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "signals"

    named = []
    for path in (PACKAGE / "core" / "recovery" / "chain.py", PACKAGE / "core" / "recovery" / "policy.py",
                 PACKAGE / "core" / "tracking.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            key = None
            if isinstance(node, ast.Subscript) and on_signals(node.value):
                key = node.slice.value if type(node.slice).__name__ == "Index" else node.slice
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and on_signals(node.func.value) and node.args:
                key = node.args[0]
            if isinstance(key, ast.Constant) and key.value in keys:
                named.append(f"{path.relative_to(ROOT)}:{node.lineno} {key.value!r}")
    assert named == []
