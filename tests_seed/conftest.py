"""Fixtures of the seed-stack suite: the user's clones (``STREAMPETR_ROOT`` / ``PETR_ROOT``), synthetic data.

Every test needs a clone and this environment's real stack (mmcv-full 1.x with its ops, mmdet 2.x, mmdet3d
1.0.0rc6: ``make env-seed``). Without them the tests skip, all at one place, so ``pytest -rs`` prints one line
saying how to run them.
"""
import importlib.util
import os
from typing import Any, Iterator

import pytest
from harness import HOW_TO_RUN, SUMMARY
from nusc_synth import CBGS_TABLE_CLASSES, write_scenes

#: What a clone must hold: the project's configs and mmdetection3d v1.0.0rc6's ``configs/_base_`` (the
#: configs' ``_base_`` paths point there), as the projects' setup docs check it out.
_NEEDED = {"StreamPETR": ("projects/mmdet3d_plugin", "projects/configs/StreamPETR",
                          "mmdetection3d/configs/_base_/datasets/nus-3d.py"),
           "PETR": ("projects/mmdet3d_plugin", "projects/configs/petrv2",
                    "mmdetection3d/configs/_base_/datasets/nus-3d.py")}


def _skip() -> None:
    # Every skip of the suite is raised here, and reported from here (pytest_runtest_makereport below).
    pytest.skip(HOW_TO_RUN)


_SKIP_LINE = _skip.__code__.co_firstlineno + 2  # the pytest.skip line above, 1-based


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Iterator[None]:
    """Reports the suite's skips at one location, so that ``pytest -rs`` folds them into one line (pytest reports a
    skip raised in a fixture at each test's own line)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple) and report.longrepr[2].endswith(HOW_TO_RUN):
        report.longrepr = (os.path.relpath(__file__), _SKIP_LINE, report.longrepr[2])


def _stack_present() -> bool:
    try:
        import mmcv
    except ImportError:
        return False
    return mmcv.__version__.startswith("1.") and all(
        importlib.util.find_spec(m) is not None for m in ("mmcv._ext", "mmdet", "mmdet3d"))


def _clone(var: str, project: str) -> str:
    root = os.environ.get(var)
    if not root or not _stack_present():
        _skip()
    missing = [p for p in _NEEDED[project] if not os.path.exists(os.path.join(root, p))]
    if missing:
        # Set but wrong: an error, not a skip (docs/seed-stack.md says how to make the clone).
        pytest.fail(f"{var}={root} is not a {project} clone with mmdetection3d v1.0.0rc6 inside: missing "
                    f"{', '.join(missing)} (docs/seed-stack.md)")
    return os.path.realpath(root)


@pytest.fixture(scope="session")
def streampetr_root() -> str:
    """The user's StreamPETR clone (``STREAMPETR_ROOT``)."""
    return _clone("STREAMPETR_ROOT", "StreamPETR")


@pytest.fixture(scope="session")
def petr_root() -> str:
    """The user's megvii PETR clone (``PETR_ROOT``)."""
    return _clone("PETR_ROOT", "PETR")


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory: Any) -> str:
    """Where every run of the session writes its work dir (kept under pytest's basetemp for inspection)."""
    return str(tmp_path_factory.mktemp("seed_runs"))


@pytest.fixture(scope="session")
def streampetr_data(tmp_path_factory: Any) -> Iterator[str]:
    """Three scenes of six key frames in StreamPETR's info format; yields the info pickle's path."""
    root = str(tmp_path_factory.mktemp("streampetr_data"))
    yield write_scenes(root, "streampetr", num_scenes=3, frames=6, seed=0)


@pytest.fixture(scope="session")
def petr_data(tmp_path_factory: Any) -> Iterator[str]:
    """Two scenes of two key frames in PETR's 30f info format; yields the info pickle's path."""
    root = str(tmp_path_factory.mktemp("petr_data"))
    yield write_scenes(root, "petr", num_scenes=2, frames=2, width=320, height=180, seed=1)


@pytest.fixture(scope="session")
def petr_cbgs_data(tmp_path_factory: Any) -> Iterator[str]:
    """Two scenes of two key frames in PETR's 30f info format with 40 objects each, so that every class of the ten
    is annotated somewhere (mmdet3d's ``CBGSDataset`` divides by each class's share); yields the info pickle's
    path."""
    root = str(tmp_path_factory.mktemp("petr_cbgs_data"))
    yield write_scenes(root, "petr", num_scenes=2, frames=2, width=320, height=180, objects=40, seed=2)


@pytest.fixture(scope="session")
def petr_cbgs_table_data(tmp_path_factory: Any) -> Iterator[str]:
    """Four one-frame scenes in PETR's 30f info format whose classes (:data:`nusc_synth.CBGS_TABLE_CLASSES`) make
    mmdet3d's ``CBGSDataset`` draw a table of ten indices, one per class, seven of them at random between two frames;
    yields the info pickle's path."""
    root = str(tmp_path_factory.mktemp("petr_cbgs_table_data"))
    yield write_scenes(root, "petr", num_scenes=4, frames=1, width=320, height=180, objects=14, seed=3,
                       scene_classes=CBGS_TABLE_CLASSES)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Every real run's wall time and iterations (the figures docs/seed-stack.md quotes)."""
    if SUMMARY:
        terminalreporter.section("seed-stack runs")
        for line in SUMMARY:
            terminalreporter.write_line(line)
