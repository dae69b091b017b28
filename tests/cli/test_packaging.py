"""What `pip install .` ships and what a new user gets from it.

The wheel (seconds): every module of the package but the repository's test helpers, the light console script, the
license, extras that name no mmcv. A fresh venv per runner family (marked `slow`: a minute or two each, most of it
pip): the pinned torch first, from this machine's disk, then the documented install lines (README.md, "Install"),
then the example trained from another directory on the installed package.
"""
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata

import pytest

import petr_stability
from petr_stability.testing.stacks import has_mmcv1, has_mmengine

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
#: What `pip install .` reads. A copy is built: a build/ folder or an egg-info left in the tree would hide a miss.
SOURCES = ("petr_stability", "petr_stability_cli.py", "setup.py", "pyproject.toml", "README.md", "LICENSE")
#: Ends a hung pip or run only; never a speed limit (pip and a cold cache on a loaded machine take minutes).
HANG_S = 1800


def _copy_sources(dst, examples=False):
    os.makedirs(dst)
    for name in SOURCES + (("examples",) if examples else ()):
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dst, name), ignore=shutil.ignore_patterns("__pycache__", "work_dirs"))
        else:
            shutil.copy(src, os.path.join(dst, name))
    return dst


def _wheel(tmp_path):
    src = _copy_sources(str(tmp_path / "src"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), src], check=True, capture_output=True, timeout=HANG_S)
    (whl,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    return zipfile.ZipFile(os.path.join(tmp_path, whl))


def _dist_info(z, name):
    return z.read(next(n for n in z.namelist() if n.split("/")[0].endswith(".dist-info") and n.endswith(name))).decode()


def test_the_built_wheel_holds_the_package_less_its_test_helpers(tmp_path):
    # A folder without __init__.py is skipped by find_packages: an editable install hides that, a wheel does not.
    with _wheel(tmp_path) as z:
        shipped = {n for n in z.namelist() if n.endswith(".py")}
        entry_points = _dist_info(z, "entry_points.txt")
        meta = _dist_info(z, "METADATA")
        licenses = [n for n in z.namelist() if ".dist-info/" in n and os.path.basename(n) == "LICENSE"]
        license_text = z.read(licenses[0]).decode() if licenses else ""
    tree = {os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
            for d, _, files in os.walk(os.path.join(ROOT, "petr_stability")) for f in files if f.endswith(".py")}
    helpers = {p for p in tree if p.startswith("petr_stability/testing/")}
    assert helpers and tree - helpers - shipped == set()
    assert shipped & helpers == set()  # the test helpers stay in the repository
    assert "petr_stability_cli.py" in shipped
    assert "petr-stability = petr_stability_cli:main" in entry_points
    assert f"\nVersion: {petr_stability.__version__}\n" in meta
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert any("mmengine" in r and "extra == \"mmengine\"" in r for r in requires), requires
    assert not [r for r in requires if "mmcv" in r], requires  # never installed over a user's own mmcv build


# ------------------------------------------------------------------ a new user's venv (slow: pip)
def _venv(tmp_path, name):
    venv = tmp_path / name
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=HANG_S)
    return venv


def _in(venv, *argv, cwd, check=True):
    """Runs a program of ``venv`` from ``cwd``, with no PYTHONPATH: only what was installed is imported."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=str(venv / "bin") + os.pathsep + env.get("PATH", ""), OMP_NUM_THREADS="1")
    res = subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], cwd=str(cwd), env=env, capture_output=True,
                         text=True, timeout=HANG_S)
    if check:
        assert res.returncode == 0, (argv, res.stdout[-3000:], res.stderr[-3000:])
    return res


def _pinned(name):
    """``name==X.Y.Z`` of this environment's own build (its local label dropped): the pin scripts/setup_envs.sh
    installs, which pip takes from this machine's disk."""
    return f"{name}=={metadata.version(name).split('+')[0]}"


def _installed_from(venv, cwd):
    res = _in(venv, "python", "-c", "import petr_stability; print(petr_stability.__file__)", cwd=cwd)
    return res.stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(not has_mmengine(), reason="the MMEngine environment's torch pin (.venv); .venv-mmcv1: MMCV 1.x")
def test_a_fresh_venv_installs_the_mmengine_extra_and_trains_the_example(tmp_path):
    src = _copy_sources(str(tmp_path / "src"), examples=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    venv = _venv(tmp_path, "venv")
    _in(venv, "pip", "install", "-q", _pinned("torch"), cwd=elsewhere)
    _in(venv, "pip", "install", "-q", src, cwd=elsewhere)
    # torch only: the command answers, and the demo names what it lacks instead of a ModuleNotFoundError
    version = _in(venv, "petr-stability", "--version", cwd=elsewhere).stdout
    assert version == f"petr-stability {petr_stability.__version__}\n"
    res = _in(venv, "petr-stability", "demo", "--quick", "--work-dir", "demo", cwd=elsewhere, check=False)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "demo needs mmengine, mmcv and matplotlib, not installed here" in res.stderr
    assert "Traceback" not in res.stderr and not (elsewhere / "demo").exists()
    assert _in(venv, "python", "-c", "import petr_stability.testing", cwd=elsewhere, check=False).returncode == 1

    _in(venv, "pip", "install", "-q", f"{src}[mmengine]", cwd=elsewhere)
    assert _installed_from(venv, elsewhere).startswith(str(venv))
    example = os.path.join(src, "examples", "mmengine")
    run = _in(venv, "python", os.path.join(example, "train.py"), os.path.join(example, "config.py"), "--work-dir",
              "wd", cwd=elsewhere)
    assert "NanGuard example: no incident; the run in wd was healthy" in run.stdout, run.stdout[-3000:]
    report = _in(venv, "petr-stability", "report", "wd", cwd=elsewhere)
    assert "incidents: 0" in report.stdout and (elsewhere / "wd" / "nan_guard_report.html").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not has_mmcv1(), reason="the MMCV 1.x environment's torch / torchvision pins (.venv-mmcv1)")
def test_a_fresh_venv_with_the_documented_mmcv1_steps_trains_the_example(tmp_path):
    # MMCV 1.x has no extra (see setup.py): the documented steps. mmcv 1.x's runner imports torchvision, so torch
    # comes with its own torchvision build (here the pair scripts/setup_envs.sh pins for .venv-mmcv1, from disk).
    src = _copy_sources(str(tmp_path / "src"), examples=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    venv = _venv(tmp_path, "venv")
    _in(venv, "pip", "install", "-q", _pinned("torch"), _pinned("torchvision"), cwd=elsewhere)
    _in(venv, "pip", "install", "-q", "mmcv>=1.4,<2", src, cwd=elsewhere)
    assert _installed_from(venv, elsewhere).startswith(str(venv))
    example = os.path.join(src, "examples", "mmcv1")
    run = _in(venv, "python", os.path.join(example, "train.py"), os.path.join(example, "config.py"), "--work-dir",
              "wd", cwd=elsewhere)
    assert "NanGuard example: no incident" in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]
