"""benchmarks/check_wheelhouse.py: a wheelhouse for the offline GPU machine is checked before it travels."""
import os
import subprocess
import sys
import zipfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CHECK = os.path.join(ROOT, "benchmarks", "check_wheelhouse.py")


def wheel(folder, name, requires):
    os.makedirs(folder, exist_ok=True)
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(os.path.join(folder, f"{name}-1.0-py3-none-any.whl"), "w") as z:
        z.writestr(f"{name}-1.0.dist-info/METADATA", meta)


def check(house, present):
    listing = os.path.join(house, "..", "present.txt")
    with open(listing, "w") as f:
        f.write("# on the machine\n" + "\n".join(present) + "\n")
    p = subprocess.run([sys.executable, CHECK, house, listing], capture_output=True, text=True)
    return p.returncode, p.stdout


def test_requirements_met_by_stack_common_or_machine_with_markers_evaluated(tmp_path):
    house = str(tmp_path / "wh")
    wheel(os.path.join(house, "common"), "addict", [])
    wheel(os.path.join(house, "a"), "mmengine", ["addict", "numpy", "opencv-python>=3",
                                                  "regex; sys_platform == 'win32'", "tomli>=2; python_version < '3.11'",
                                                  "pytest; extra == 'tests'"])
    rc, out = check(house, ["numpy", "opencv-python-headless"])
    assert rc == 0 and "a: 2 wheels, requirements met" in out


def test_a_missing_requirement_is_named_and_fails(tmp_path):
    house = str(tmp_path / "wh")
    wheel(os.path.join(house, "common"), "project", ["termcolor"])
    wheel(os.path.join(house, "a"), "mmcv", ["addict", "numpy"])
    wheel(os.path.join(house, "b"), "mmcv_other", ["numpy"])  # another stack's wheels do not count for "a"
    wheel(os.path.join(house, "b"), "addict", [])
    rc, out = check(house, ["numpy"])
    assert rc == 1
    assert "a: mmcv-1.0-py3-none-any.whl needs addict" in out
    assert "a: project-1.0-py3-none-any.whl needs termcolor" in out
    assert "b: project-1.0-py3-none-any.whl needs termcolor" in out and "b: 3 wheels, requirements NOT met" in out
