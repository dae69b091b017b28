"""The test side of the seed-stack suite: where the clones are, the synthetic data, one run per subprocess.

Each run is ``seed_run.py`` in a fresh interpreter of this environment (``.venv-seed``), one at a time (the
machine's cores are shared); its result is a JSON file plus the run's work dir, read here with
``petr_stability.read_incidents``. The heavy imports (mmdet3d, the projects' plugins) happen in the children only.
"""
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from petr_stability import read_incidents

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

#: The one line every skip of this suite says (conftest.py uses it too).
HOW_TO_RUN = ("seed-stack suite (opt-in): make env-seed && STREAMPETR_ROOT=/path/to/StreamPETR "
              "PETR_ROOT=/path/to/PETR make test-seed-stack (docs/seed-stack.md)")

#: Every run's summary line, printed at the end of the session (conftest.py).
SUMMARY: List[str] = []


class RunResult:
    """One finished run: the child's JSON result, its work dir and its incidents."""

    def __init__(self, data: Dict[str, Any], work_dir: str, log: str, first_record: int = 0) -> None:
        self.data = data
        self.work_dir = work_dir
        self.log = log
        #: Records of the work dir's incident log written before this run (a resumed run appends to it).
        self.first_record = first_record

    @property
    def error(self) -> Optional[Dict[str, Any]]:
        return self.data.get("error")

    @property
    def iterations(self) -> List[Dict[str, Any]]:
        """Every iteration the run executed (a rollback makes numbers repeat), in order."""
        return self.data.get("iterations") or []

    @property
    def final(self) -> Dict[str, Any]:
        return self.data.get("final") or {}

    def remedy_state(self, name: str) -> Dict[str, Any]:
        """The remedy ``name``'s state in the guard's final state (``remedies.<name>``: one layout for every remedy)."""
        return dict(((self.final.get("guard_state") or {}).get("remedies") or {}).get(name) or {})

    def incidents(self, event: Optional[str] = None) -> List[Dict[str, Any]]:
        records = read_incidents(self.work_dir)[self.first_record:]
        return [r for r in records if event is None or r.get("event") == event]

    def divergences(self) -> List[Dict[str, Any]]:
        return self.incidents("divergence")

    def token_of(self, index: int) -> str:
        return self.data["dataset"][index]["token"]

    def index_of(self, token: str) -> int:
        return next(d["index"] for d in self.data["dataset"] if d["token"] == token)

    def iteration_seconds(self, healthy_only: bool = True) -> List[float]:
        """Seconds per executed iteration (data loading excluded), the guard's own time included."""
        out = []
        for it in self.iterations:
            if it.get("unfinished") or "seconds" not in it:
                continue
            if healthy_only and it.get("iter_after_guard") != it.get("iter_before_guard"):
                continue  # a rollback iteration carries the diagnosis
            out.append(float(it["seconds"]))
        return out

    def guard_seconds(self, it: Dict[str, Any], cpu: bool = False) -> float:
        """The guard's own time in iteration ``it`` (its two hook methods), wall or CPU."""
        unit = "_cpu_s" if cpu else "_s"
        return (float(it.get("guard_before_train_iter" + unit, 0.0))
                + float(it.get("guard_after_train_iter" + unit, 0.0)))

    def describe(self) -> str:
        """The run in a few lines, for assertion messages: error, incidents, iterations."""
        error = self.error and f"{self.error['type']}: {self.error['message'][:600]}"
        lines = [f"work dir {self.work_dir}; error: {error}"]
        for r in self.incidents():
            cause = r.get("cause") or {}
            lines.append(f"  incident {r.get('event')} at iter {r.get('iteration')}: {r.get('reason')}; cause "
                         f"{cause.get('cause')} ({cause.get('evidence')}); modules {cause.get('modules')}; actions "
                         f"{[(a.get('target'), a.get('old'), a.get('new')) for a in r.get('actions') or []][:6]}; "
                         f"restored {r.get('restored_from')}")
        for it in self.iterations:
            lines.append(f"  iter {it.get('iteration')}: idx {it.get('indices')} prev {it.get('prev_exists')} "
                         f"mem {it.get('memory_at_start')}->{it.get('memory_after_guard')} "
                         f"unchanged {it.get('memory_unchanged_by_guard')} loss {it.get('loss')} "
                         f"gn {it.get('grad_norm')} scale {it.get('loss_scale')} "
                         f"iter {it.get('iter_before_guard')}->{it.get('iter_after_guard')} "
                         f"{it.get('seconds', 0):.1f}s guard {self.guard_seconds(it):.3f}s")
        return "\n".join(lines)


def run_seed(name: str, spec: Dict[str, Any], base: str, timeout: float = 1500.0,
             work_dir: Optional[str] = None) -> RunResult:
    """Runs ``spec`` (see seed_run.py) in a child process under ``base/name``; returns its result.

    Args:
        name: the run's name (its work dir, its summary line).
        spec: what to run.
        base: the directory of the session's runs.
        timeout: seconds before the child is killed (a failure).
        work_dir: another run's work dir to work in (a resumed run: as a user restarts the job where it ran).
            Defaults to ``base/name``.

    Raises:
        AssertionError: the child crashed (not a guard error: those are in the result) or timed out; the
            message holds the end of its output.
    """
    work_dir = work_dir or os.path.join(base, name)
    os.makedirs(work_dir, exist_ok=True)
    spec = dict(spec, work_dir=work_dir, result=os.path.join(work_dir, f"result_{name}.json"))
    spec_path = os.path.join(work_dir, f"spec_{name}.json")
    first_record = len(read_incidents(work_dir))
    with open(spec_path, "w") as fh:
        json.dump(spec, fh, indent=1)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", str(spec.get("threads", 2)))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.join(HERE, "seed_run.py"), spec_path], cwd=spec["root"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - t0
    log = proc.stdout.decode(errors="replace")
    with open(os.path.join(work_dir, f"child_{name}.log"), "w") as fh:
        fh.write(log)
    if proc.returncode != 0 or not os.path.exists(spec["result"]):
        raise AssertionError(f"seed run {name} crashed (exit {proc.returncode}); last output:\n{log[-6000:]}")
    with open(spec["result"]) as fh:
        result = RunResult(json.load(fh), work_dir, log, first_record)
    secs = result.iteration_seconds()
    SUMMARY.append(f"{name}: {wall:.0f} s wall, {len(result.iterations)} iterations"
                   + (f", median healthy iteration {sorted(secs)[len(secs) // 2]:.1f} s" if secs else "")
                   + f", {len(result.incidents())} incident record(s)"
                   + (f", error {result.error['type']}" if result.error else ""))
    return result


class Expect:
    """Collects every failed expectation of a test, so that one run reports all of them at once."""

    def __init__(self, result: RunResult) -> None:
        self.result = result
        self.failed: List[str] = []

    def __call__(self, ok: Any, what: str) -> bool:
        if not ok:
            self.failed.append(what)
        return bool(ok)

    def check(self) -> None:
        assert not self.failed, ("\n".join(f"- {f}" for f in self.failed) + "\n\nthe run:\n"
                                 + self.result.describe())


def check_all(**expects: Expect) -> None:
    """Reports the failed expectations of several runs of one test at once, each run described under them."""
    failed = [f"- {name}: {f}" for name, e in expects.items() for f in e.failed]
    assert not failed, "\n".join(failed) + "".join(f"\n\n{name}:\n{e.result.describe()}"
                                                    for name, e in expects.items())


def median(values: List[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def after(result: RunResult, iteration_index: int) -> List[Dict[str, Any]]:
    """The executed iterations after position ``iteration_index`` in the run's order."""
    return result.iterations[iteration_index + 1:]


def position(result: RunResult, pred: Callable[[Dict[str, Any]], bool]) -> int:
    """Position (in execution order) of the first iteration matching ``pred``; -1 if none."""
    return next((i for i, it in enumerate(result.iterations) if pred(it)), -1)


def memory_ok_everywhere(expect: Expect, result: RunResult) -> None:
    """StreamPETR's memory never holds NaN/Inf when an iteration starts, nor when the run ends."""
    bad = [it["iteration"] for it in result.iterations if it.get("memory_at_start") == "nonfinite"]
    expect(not bad, f"memory non-finite at the start of iterations {bad}")
    expect(result.final.get("memory") in ("finite", "reset"), f"memory at the end: {result.final.get('memory')}")


def diagnosis_costs(result: RunResult) -> List[str]:
    """Each incident's cost: the record's ``diagnosis.seconds`` (wall) against the run's median healthy iteration,
    and the guard's CPU time in that iteration (diagnosis, remedies, restore) against a healthy iteration's CPU
    time (less stretched by other jobs on the machine)."""
    wall = median(result.iteration_seconds())
    healthy_cpu = median([float(it["cpu_seconds"]) for it in result.iterations if "cpu_seconds" in it
                          and it.get("iter_after_guard") == it.get("iter_before_guard")
                          and it.get("grad_norm") not in ("inf", "nan", None)])
    out = []
    for r in result.incidents():
        secs = (r.get("diagnosis") or {}).get("seconds")
        if not isinstance(secs, (int, float)):
            continue
        line = f"iter {r['iteration']}: diagnosis {secs:.1f} s = {secs / wall:.1f} x a {wall:.1f} s iteration"
        its = [it for it in result.iterations if it["iteration"] == r["iteration"] and "guard_after_train_iter_cpu_s"
               in it and it["guard_after_train_iter_cpu_s"] > 0.5]
        if its and not math.isnan(healthy_cpu):
            cpu = its[-1]["guard_after_train_iter_cpu_s"]
            line += f"; guard CPU {cpu:.1f} s = {cpu / healthy_cpu:.1f} x a healthy iteration's {healthy_cpu:.1f} s"
        out.append(line)
    return out
