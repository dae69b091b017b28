"""Running ``examples/<family>`` as a newcomer types it, for the examples' tests in both environments.

``python examples/<family>/train.py examples/<family>/config.py --work-dir DIR [extra]`` in a subprocess (the
example's own model registers in the framework's global registries; the test process stays clean), from a working
directory outside the repository, with the repository on ``PYTHONPATH`` as the README allows instead of
``pip install -e .``.
"""
import ast
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch

__all__ = ["ROOT", "HANG_S", "BAD_SAMPLE", "ExampleRun", "example_env", "train_example", "config_values",
           "load_checkpoint", "all_finite", "check_readme_lines", "check_healthy", "check_bad_sample", "guard_state",
           "check_user_remedy", "check_next_incident"]

ROOT = Path(__file__).resolve().parents[2]
#: Ends a hung example only: a run takes 6-22 s here (examples/README.md), and no verdict rests on how long it took
#: (a loaded machine is slower, not wrong).
HANG_S = 1800
#: The sample index ``--bad-sample`` corrupts in the tests.
BAD_SAMPLE = 10


class ExampleRun(NamedTuple):
    """One example run: its work dir, exit status, output (stdout and stderr) and wall time."""

    work_dir: Path
    returncode: int
    output: str
    seconds: float

    def tail(self) -> str:
        return self.output[-4000:]


def example_env(*paths: str) -> Dict[str, str]:
    """The environment with the repository (and ``paths``: a user's own packages) on ``PYTHONPATH``."""
    entries = (str(ROOT),) + paths + (os.environ.get("PYTHONPATH", ""),)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in entries if p))


def train_example(example: Path, work_dir: Path, *extra: str, config: Optional[Path] = None,
                  paths: Sequence[str] = ()) -> ExampleRun:
    """Runs ``example``'s ``train.py`` on its ``config.py`` (or ``config``) into ``work_dir``, from ``work_dir``'s
    parent (nothing may depend on being started from the repository root); ``paths`` go on ``PYTHONPATH`` (a user's
    own package, importable as in a real project)."""
    config = config if config is not None else example / "config.py"
    cmd = [sys.executable, str(example / "train.py"), str(config), "--work-dir", str(work_dir), *extra]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=str(work_dir.parent), env=example_env(*paths), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=HANG_S)
    run = ExampleRun(work_dir, proc.returncode, proc.stdout, time.monotonic() - start)
    print(f"{' '.join(cmd[1:])}: exit {run.returncode} in {run.seconds:.1f} s")
    return run


def config_values(path: Path, *names: str) -> Dict[str, Any]:
    """The named top-level assignments of a config, evaluated with ``dict`` only (the file is not executed)."""
    values: Dict[str, Any] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names:
            expr = ast.Expression(node.value)
            values[node.targets[0].id] = eval(compile(expr, str(path), "eval"), {"__builtins__": {}, "dict": dict})
    return values


def load_checkpoint(path: str) -> Dict[str, Any]:
    """A checkpoint the run wrote a moment ago (``weights_only=False``: the frameworks' meta pickles their types)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except TypeError:  # torch < 1.13: no weights_only, and everything is loaded anyway
        return torch.load(path, map_location="cpu")


def all_finite(state: Dict[str, Any]) -> bool:
    """Every floating tensor of a state dict is finite."""
    return all(bool(torch.isfinite(v).all()) for v in state.values() if torch.is_tensor(v) and v.is_floating_point())


def check_readme_lines(example: Path) -> None:
    """The README's hook line verbatim; its import line with the example's own model next to petr_stability."""
    assert "custom_hooks = [dict(type='NanGuardHook')]" in (example / "config.py").read_text().splitlines()
    values = config_values(example / "config.py", "custom_imports", "custom_hooks")
    assert values["custom_hooks"] == [{"type": "NanGuardHook"}]
    assert values["custom_imports"] == {"imports": ["petr_stability", "toy_detector"], "allow_failed_imports": False}


def _finished(run: ExampleRun) -> None:
    assert run.returncode == 0, run.tail()


def check_healthy(run: ExampleRun, state: Dict[str, Any]) -> None:
    """A healthy run: finished, the guard in the hook table and its scalars logged, no incident record,
    finite weights in ``state`` (the run's newest checkpoint)."""
    from petr_stability import INCIDENT_FILE, read_incidents

    _finished(run)
    assert "NanGuardHook" in run.output, run.tail()
    assert "nan_guard/incidents: 0.0000" in run.output, run.tail()
    log = run.work_dir / INCIDENT_FILE
    assert not log.exists() or read_incidents(str(run.work_dir)) == [], log.read_text()
    assert "no incident" in run.output
    assert all_finite(state)


def check_bad_sample(run: ExampleRun, state: Dict[str, Any]) -> None:
    """A run with a corrupt sample: finished, the guard's own log lines, at least one incident record,
    finite weights in ``state``."""
    from petr_stability import read_incidents

    _finished(run)
    assert "NanGuard:" in run.output, run.tail()
    records = read_incidents(str(run.work_dir))
    assert len(records) >= 1 and all(isinstance(r, dict) for r in records), records
    assert all_finite(state)


def guard_state(checkpoint: Dict[str, Any]) -> Dict[str, Any]:
    """The guard's state a checkpoint carries (MMEngine: a top-level key; MMCV 1.x: in ``meta``)."""
    return checkpoint.get("nan_guard") or checkpoint["meta"]["nan_guard"]


def check_user_remedy(example: Path, tmp: Path, resume: str) -> None:
    """examples/user_remedy end to end on ``example``'s train script: the user's remedies (beta2, an absolute target;
    decay, a relative one) act on their cause, ride in the checkpoints and survive a resume (``resume``: the
    ``--cfg-options`` entry naming the checkpoint, ``{ckpt}`` filled in) without applying anything twice, and the
    next run from the patched config starts with them re-applied (docs/remedies.md)."""
    import glob

    from petr_stability import read_incidents

    config = ROOT / "examples" / "user_remedy" / f"{example.name}_config.py"
    first = train_example(example, tmp / "run1", config=config)
    assert first.returncode == 0, first.tail()
    alone, rec = read_incidents(str(first.work_dir))  # the fire drill's first NaN is rolled back alone (issue 43)
    assert alone["cause"]["signals"].get("rollback_alone") and not alone["actions"], alone
    assert rec["event"] == "divergence" and rec["cause"]["cause"] == "dynamics"
    assert {"target": "optimizer0.group0.betas[1]", "old": 0.999, "new": 0.95} in rec["actions"]
    assert {"target": "optimizer0.group0.weight_decay", "old": 0.01, "new": 0.005} in rec["actions"]
    assert rec["cause"]["evidence"].endswith("; Adam beta2 0.95; weight decay x 0.5"), rec["cause"]["evidence"]
    checkpoints = sorted(glob.glob(str(first.work_dir / "*.pth")))
    for path in checkpoints:  # every checkpoint after the incident: the remedies' state and the optimizer's values
        ckpt = load_checkpoint(path)
        state = guard_state(ckpt)
        assert state["remedies"]["decay"] == {"decay_scale": 0.5}, path
        assert state["targets"]["beta2"] == {"betas[1]": {"value": 0.95, "relative": False, "base": {}}}, path
        assert state["targets"]["decay"]["weight_decay"]["base"] == {"0.0": 0.01}, path
        _check_groups(ckpt, 0.95, 0.005, path)
    patched = (first.work_dir / "nan_guard_patched_config.py").read_text()
    assert "carried for beta2" in patched and "carry=dict(" in patched and "type='FaultInjectionHook'" not in patched
    again = train_example(example, tmp / "run2", "--cfg-options", resume.format(ckpt=checkpoints[0]), config=config)
    assert again.returncode == 0, again.tail()
    last = load_checkpoint(sorted(glob.glob(str(again.work_dir / "*.pth")))[-1])
    assert guard_state(last)["remedies"]["decay"] == {"decay_scale": 0.5}
    _check_groups(last, 0.95, 0.005, "resumed")  # 0.005, not 0.0025: a relative target is not applied twice
    # The next run: the user's package importable as in a real project (the config's own sys.path line, code and not a
    # setting, is not in a flat patched config).
    following = train_example(example, tmp / "run3", config=first.work_dir / "nan_guard_patched_config.py",
                              paths=(str(config.parent),))
    assert following.returncode == 0, following.tail()
    assert "carried from the earlier run: optimizer0.group0.betas[1]: 0.999 -> 0.95" in following.output
    assert "carried from the earlier run: optimizer0.group0.weight_decay: 0.01 -> 0.005" in following.output
    assert read_incidents(str(following.work_dir)) == []
    last = load_checkpoint(sorted(glob.glob(str(following.work_dir / "*.pth")))[-1])
    _check_groups(last, 0.95, 0.005, "the next run")
    assert guard_state(last)["remedies"]["decay"] == {"decay_scale": 0.5}
    # The toy detector builds its transformer in code: no config key holds its dropouts, so the patched config
    # carries every module run 1 zeroed, and the next run sets them to 0 before its first iteration.
    zeroed = [a["target"] for a in rec["actions"] if a["new"] == 0.0]
    assert zeroed and "no transformer found in the detection head" in patched
    for target in zeroed:
        assert f"carried from the earlier run: {target}: 0.1 -> 0.0" in following.output, target
    check_next_incident(example, tmp, first.work_dir / "nan_guard_patched_config.py", zeroed)


def _check_groups(checkpoint: Dict[str, Any], beta2: float, decay: float, where: Any) -> None:
    for group in checkpoint["optimizer"]["param_groups"]:
        assert group["betas"][1] == beta2 and group["weight_decay"] == decay, (where, group["betas"],
                                                                             group["weight_decay"])


def check_next_incident(example: Path, tmp: Path, patched: Path, zeroed: List[str]) -> None:
    """The next run from the patched config, the same fire drill planted again: its first NaN is rolled back alone,
    and its second is not the one run 1 fixed (the known manual fix is in force from the first iteration: the ladder
    goes on to its next rung)."""
    import glob

    from petr_stability import read_incidents
    from petr_stability.configfix import load_config

    hooks = [h for h in load_config(str(patched))["custom_hooks"] if "NanGuardHook" in str(h.get("type"))]
    drill = dict(type="FaultInjectionHook", faults=[dict(kind="weights", iters=[12, 14], value="nan")])
    config = tmp / "drill_again.py"
    config.write_text(f"_base_ = [{str(patched)!r}]\ncustom_hooks = {hooks + [drill]!r}\n")
    run = train_example(example, tmp / "run4", config=config, paths=(str(ROOT / "examples" / "user_remedy"),))
    assert run.returncode == 0, run.tail()
    alone, rec = read_incidents(str(run.work_dir))
    assert alone["cause"]["signals"].get("rollback_alone") and not alone["actions"], alone
    assert rec["cause"]["cause"] == "dynamics" and "in force already" in rec["cause"]["evidence"], rec["cause"]
    targets = [a["target"] for a in rec["actions"]]
    assert not set(zeroed) & set(targets) and not any("max_norm" in t for t in targets), targets
    assert any(t.endswith(".lr") for t in targets), targets  # the learning-rate rung
    # The relative target acts once more (x 0.25 of the config's 0.01), the absolute one is in force already.
    assert {"target": "optimizer0.group0.weight_decay", "old": 0.005, "new": 0.0025} in rec["actions"], rec["actions"]
    assert not any(t.endswith("betas[1]") for t in targets), targets
    last = load_checkpoint(sorted(glob.glob(str(run.work_dir / "*.pth")))[-1])
    _check_groups(last, 0.95, 0.0025, "the next incident")
