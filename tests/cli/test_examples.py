"""examples/mmengine end to end, as a newcomer types it: ``python examples/mmengine/train.py CONFIG --work-dir DIR``.

Each run is a subprocess (the example's own model registers in MMEngine's global registries; this process stays
clean). Asserted: the config carries the README's ``custom_hooks`` line and registers the guard and the model for
any script that reads it; a healthy run finishes with the guard active and no incident; with ``--bad-sample`` (a
corrupt image) the run still finishes, with finite weights and at least one incident record. How the guard recovers
from the bad sample is not asserted here (the hook's own tests do).
"""
import ast
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, NamedTuple

import pytest

from petr_stability.testing.stacks import require

require("mmengine")

import torch  # noqa: E402

from petr_stability import INCIDENT_FILE, read_incidents  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "mmengine"
#: examples/README.md promises a run in well under a minute; a run took 10-19 s here (2 busy CPU cores).
BUDGET_S = 60.0
BAD_SAMPLE = 10


class Run(NamedTuple):
    work_dir: Path
    returncode: int
    output: str
    seconds: float


def _env() -> Dict[str, str]:
    # The repository on PYTHONPATH, as the README allows instead of `pip install -e .`.
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def _train(work_dir: Path, *extra: str) -> Run:
    cmd = [sys.executable, str(EXAMPLE / "train.py"), str(EXAMPLE / "config.py"), "--work-dir", str(work_dir), *extra]
    start = time.monotonic()
    # cwd elsewhere than the repository: nothing may depend on being started from the repository root.
    proc = subprocess.run(cmd, cwd=str(work_dir.parent), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    run = Run(work_dir, proc.returncode, proc.stdout, time.monotonic() - start)
    print(f"{' '.join(cmd[1:])}: exit {run.returncode} in {run.seconds:.1f} s")
    return run


def _tail(run: Run) -> str:
    return run.output[-4000:]


def _load(path: str) -> Dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except TypeError:  # torch < 1.13: no weights_only, and everything is loaded anyway
        return torch.load(path, map_location="cpu")


def _last_state_dict(work_dir: Path) -> Dict[str, Any]:
    # MMEngine names its newest checkpoint in `last_checkpoint`. weights_only=False: MMEngine's meta pickles its own
    # types, and this is the file the run wrote a moment ago.
    return _load((work_dir / "last_checkpoint").read_text().strip())["state_dict"]


def _all_finite(state: Dict[str, Any]) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values() if torch.is_tensor(v) and v.is_floating_point())


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Run:
    return _train(tmp_path_factory.mktemp("healthy") / "work_dir")


@pytest.fixture(scope="module")
def bad_sample(tmp_path_factory) -> Run:
    return _train(tmp_path_factory.mktemp("bad_sample") / "work_dir", "--bad-sample", str(BAD_SAMPLE))


def _config_values(path: Path, *names: str) -> Dict[str, Any]:
    """The named top-level assignments of a config, evaluated with ``dict`` only (the file is not executed)."""
    values: Dict[str, Any] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names:
            expr = ast.Expression(node.value)
            values[node.targets[0].id] = eval(compile(expr, str(path), "eval"), {"__builtins__": {}, "dict": dict})
    return values


def test_config_holds_the_readme_lines():
    """The README's hook line verbatim; its import line with the example's own model next to petr_stability."""
    assert "custom_hooks = [dict(type='NanGuardHook')]" in (EXAMPLE / "config.py").read_text().splitlines()
    values = _config_values(EXAMPLE / "config.py", "custom_imports", "custom_hooks")
    assert values["custom_hooks"] == [{"type": "NanGuardHook"}]
    assert values["custom_imports"] == {"imports": ["petr_stability", "toy_detector"], "allow_failed_imports": False}



def test_config_loads_outside_its_train_script(tmp_path):
    """Any train script that reads the config with ``Config.fromfile`` gets the guard and the toy model registered."""
    script = tmp_path / "another_train_script.py"
    script.write_text("\n".join([
        "import sys",
        "from mmengine.config import Config",
        "Config.fromfile(sys.argv[1])",
        "from mmengine.registry import HOOKS, MODELS",
        "assert HOOKS.get('NanGuardHook') and MODELS.get('ToyDetector'), 'not registered'",
    ]))
    proc = subprocess.run([sys.executable, str(script), str(EXAMPLE / "config.py")], cwd=str(tmp_path), env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_healthy_run_finishes_guarded_without_incident(healthy):
    assert healthy.returncode == 0, _tail(healthy)
    assert healthy.seconds < BUDGET_S, f"the example took {healthy.seconds:.0f} s (budget {BUDGET_S:.0f} s)"
    # The guard is in the runner's hook table and reports its scalars in every log line.
    assert "NanGuardHook" in healthy.output, _tail(healthy)
    assert "nan_guard/incidents: 0.0000" in healthy.output, _tail(healthy)
    log = healthy.work_dir / INCIDENT_FILE
    assert not log.exists() or read_incidents(str(healthy.work_dir)) == [], log.read_text()
    assert "no incident" in healthy.output
    assert _all_finite(_last_state_dict(healthy.work_dir))


def test_bad_sample_run_finishes_with_an_incident_record(bad_sample):
    assert bad_sample.returncode == 0, _tail(bad_sample)
    assert bad_sample.seconds < BUDGET_S, f"the example took {bad_sample.seconds:.0f} s (budget {BUDGET_S:.0f} s)"
    assert "NanGuard:" in bad_sample.output, _tail(bad_sample)  # the guard's own log lines
    records = read_incidents(str(bad_sample.work_dir))
    assert len(records) >= 1 and all(isinstance(r, dict) for r in records), records
    assert _all_finite(_last_state_dict(bad_sample.work_dir))
