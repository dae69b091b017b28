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


def test_how_it_works_lists_the_files_one_divergence_goes_through():
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    section = text.split("## One divergence, file by file", 1)[1].split("\n## ", 1)[0]
    files = re.findall(r"^\d+\. `(petr_stability/[\w/]+\.py)`", section, re.M)
    assert 1 <= len(files) <= 5, files
    for path in files:
        assert (ROOT / path).is_file(), path
    # The path is real: each file names the next step's entry point.
    first, *_, last = files
    assert "after_iter" in (ROOT / first).read_text()
    assert "IncidentLog" in (ROOT / last).read_text() or "step_record" in (ROOT / last).read_text()


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
