"""Checks that each stack of a wheelhouse installs with --no-deps on a machine without network.

    python benchmarks/check_wheelhouse.py WHEELHOUSE PACKAGE_LIST

Each wheel's ``Requires-Dist`` (for Python 3.12, no extras) must name a wheel of the same stack or of
``common``, or a package in PACKAGE_LIST (what the target machine already has). Prints what is missing and exits 1.
"""
import glob
import os
import re
import sys
import zipfile
from typing import Dict, List, Set

# opencv-python and opencv-python-headless are the same module (cv2); either satisfies the other.
ALIASES = {"opencv-python": "opencv-python-headless"}


def norm(name: str) -> str:
    name = re.sub(r"[-_.]+", "-", name).lower()
    return ALIASES.get(name, name)


#: The target machine, for environment markers (``regex; sys_platform == 'win32'``, ``tomli; python_version < '3.11'``).
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def requirements(wheel: str) -> List[str]:
    """The distributions ``wheel`` needs on the target machine (extras left out)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line[len("Requires-Dist:"):].strip())
            if req.marker is None or req.marker.evaluate(TARGET):
                out.append(norm(req.name))
    return out


def dist_name(wheel: str) -> str:
    return norm(os.path.basename(wheel).split("-")[0])


def main(house: str, package_list: str) -> int:
    with open(package_list, encoding="utf-8") as f:
        present = {norm(line.strip()) for line in f if line.strip() and not line.startswith("#")}
    stacks: Dict[str, List[str]] = {d: sorted(glob.glob(os.path.join(house, d, "*.whl")))
                                    for d in sorted(os.listdir(house)) if os.path.isdir(os.path.join(house, d))}
    common = stacks.pop("common", [])
    failed = False
    for stack, wheels in stacks.items():
        available: Set[str] = present | {dist_name(w) for w in common + wheels}
        missing = [(os.path.basename(w), r) for w in common + wheels for r in requirements(w) if r not in available]
        for wheel, req in missing:
            print(f"{stack}: {wheel} needs {req}: neither in the wheelhouse nor on the machine")
        print(f"{stack}: {len(common) + len(wheels)} wheels, requirements {'NOT met' if missing else 'met'}")
        failed = failed or bool(missing)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
