"""The files one divergence really passes through, measured: a profiler around the driver's ``after_iter`` of the
iteration that diverges (NaN weights written twice, a driven torch loop with the replay on: the second divergence,
the one the ladder answers), as docs/how-it-works.md lists them."""
import pathlib
import sys
import tempfile
from typing import Any, Dict, List, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[2]


def trace_divergence(root: pathlib.Path = ROOT) -> Tuple[List[str], int]:
    """(the package files, in first-call order, and the distinct cross-file hops: caller file -> callee file) of one
    divergence from the driver on."""
    from test_incident_schema import nan_weights, run

    from petr_stability.adapters import driver as driver_module

    package = str(root / "petr_stability") + "/"
    files: List[str] = []
    hops: Set[Tuple[str, str]] = set()
    real = driver_module.GuardDriver.after_iter

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        here = frame.f_code.co_filename
        if not here.startswith(package):
            return
        rel = here[len(str(root)) + 1:]
        if rel not in files:
            files.append(rel)
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(package):
            caller = caller.f_back
        if caller is not None and caller.f_code.co_filename != here:
            hops.add((caller.f_code.co_filename[len(str(root)) + 1:], rel))

    traced: Dict[str, Any] = {}

    def after_iter(self: Any) -> None:
        before = self.guard.recoveries
        if traced:
            return real(self)
        sys.setprofile(profile)
        try:
            real(self)
        finally:
            sys.setprofile(None)
        if self.guard.recoveries in (before, 1):  # not the ladder's divergence: measure the next iteration
            files.clear()
            hops.clear()
        else:
            traced["done"] = True

    driver_module.GuardDriver.after_iter = after_iter
    try:
        with tempfile.TemporaryDirectory() as work_dir:
            # The first NaN written between two steps is rolled back alone (issue 43); the second climbs the ladder.
            run(work_dir, 10, {4: nan_weights, 6: nan_weights})
    finally:
        driver_module.GuardDriver.after_iter = real
    assert traced, "no divergence was recovered"
    return files, len(hops)


def documented(text: str) -> Set[str]:
    """The files docs/how-it-works.md's "One divergence, file by file" lists as the measured path."""
    import re

    section = text.split("## One divergence, file by file", 1)[1].split("\n## ", 1)[0]
    measured = section.split("<!-- measured path -->", 1)[1].split("<!-- end of measured path -->", 1)[0]
    return set(re.findall(r"`(petr_stability/[\w/]+\.py)`", measured))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests" / "core"))
    found, hops = trace_divergence()
    print(len(found), "files,", hops, "cross-file hops")
    print("\n".join(found))
