"""What `pip install .` (not editable) ships: every folder of the package, the console script."""
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def test_the_built_wheel_holds_every_module_of_the_tree(tmp_path):
    # A folder without __init__.py is skipped by find_packages: an editable install hides that, a wheel does not.
    # Built from a copy of the sources: a build/ folder left by an earlier build would hide a missing module.
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "petr_stability"), src / "petr_stability",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True)
    (whl,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    with zipfile.ZipFile(os.path.join(tmp_path, whl)) as z:
        shipped = {n for n in z.namelist() if n.endswith(".py")}
        entry_points = z.read(next(n for n in z.namelist() if n.endswith("entry_points.txt"))).decode()
    tree = {os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
            for d, _, files in os.walk(os.path.join(ROOT, "petr_stability")) for f in files if f.endswith(".py")}
    assert tree - shipped == set()
    assert "petr-stability = petr_stability.cli:main" in entry_points
