"""Run lineage on a real MMCV 1.x IterBasedRunner (issue 13): a rollback stays inside its own run.

A fresh run in a work dir that holds an older run's checkpoints never restores them; a run resumed after a SIGKILL
keeps its run id, so a checkpoint the killed process wrote stays a rollback target; a fault on a checkpoint
iteration with no earlier checkpoint recovers from the run's own in-memory state. Faults are planted at fixed
iterations (1-based, as logged). The disk is the last restore point (docs/how-it-works.md, "Restore points"): to
reach it, one iteration is poisoned on several passes in a row (:class:`PoisonEveryPass`: the fire drill's faults
fire once per iteration number) while no snapshot is ever confirmed, so each pass spends one in-memory point. At most
three incidents per chain: more would climb past the recovery ladder's last rung.
"""
import glob
import logging
import os
import signal
import subprocess
import sys

import pytest
import torch
from harness import build_runner, guard_hook, params_finite, run
from mmcv.runner import Hook

from petr_stability import read_incidents
from petr_stability.core.faults import poison_weights
from petr_stability.core.safe_load import safe_load

__all__ = []

HERE = os.path.dirname(os.path.abspath(__file__))
#: No snapshot is ever confirmed: an incident chain never ends, so no restore point is tried twice. No replay of
#: the failing batch: its cause classification (data, dynamics, ...) is not what these tests are about.
NO_CONFIRM = dict(snapshot_interval=1000, confirm_steps=1000, check_interval=1000, max_recoveries=10,
                  diagnose=False)
#: A dynamic loss scale starting at 2**30 overflows for its first ~20 iterations on this model while it calibrates:
#: no step is applied, so no snapshot is taken and the run's start state is its only in-memory restore point.
CALIBRATING = dict(init_scale=2.0 ** 30)


class PoisonEveryPass(Hook):
    """Plants NaN in the weights each of the first ``passes`` times iteration ``at`` (1-based) starts."""

    def __init__(self, at, passes):
        self.at, self.left = at, passes

    def before_train_iter(self, runner):
        if runner.iter + 1 == self.at and self.left > 0:
            self.left -= 1
            poison_weights(runner.model)


class Captured(logging.Handler):
    """Keeps every message written to a runner's logger."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def watch(r):
    """The runner's log lines from now on."""
    handler = Captured()
    r.logger.addHandler(handler)
    return handler.lines


def divergences(work_dir):
    return [rec for rec in read_incidents(work_dir) if rec["event"] == "divergence"]


def pth(work_dir):
    return sorted(p for p in glob.glob(os.path.join(work_dir, "*.pth")) if not os.path.islink(p))


def run_id_of(path):
    return safe_load(path, extra_globals=())["meta"]["nan_guard"]["run_id"]


def finite_file(path):
    ckpt = safe_load(path, extra_globals=())
    return all(bool(torch.isfinite(v).all()) for v in ckpt["state_dict"].values() if v.is_floating_point())


def test_fresh_run_beside_an_older_runs_checkpoints_recovers_from_its_own_state(tmp_path):
    wd = str(tmp_path)
    older = build_runner(wd, runner="iter", max_iters=20, guard=dict(snapshot_interval=5, confirm_steps=3),
                         checkpoint=dict(interval=7))
    run(older)
    theirs = {p: run_id_of(p) for p in pth(wd)}
    assert sorted(os.path.basename(p) for p in theirs) == ["iter_14.pth", "iter_20.pth", "iter_7.pth"]

    # A new run in the same work dir diverges at iteration 7, twice: the first pass takes the start state, the
    # second reaches the disk. Its own files are iter_2/4/6; the older iter_7.pth is newer than any of them and not
    # beyond iteration 7: only its run id rules it out.
    fresh = build_runner(wd, runner="iter", amp=CALIBRATING, max_iters=9, guard=NO_CONFIRM,
                         checkpoint=dict(interval=2))
    fresh.register_hook(PoisonEveryPass(7, 2), priority="NORMAL")
    lines = watch(fresh)
    run(fresh)
    guard = guard_hook(fresh).guard
    assert guard.run_id not in set(theirs.values())
    recs = divergences(wd)
    assert [r["iteration"] for r in recs] == [7, 7]
    assert [r["restored_from"] for r in recs] == [{"source": "start", "iteration": 0},
                                                   {"source": os.path.join(wd, "iter_6.pth"), "iteration": 6}]
    assert run_id_of(os.path.join(wd, "iter_6.pth")) == guard.run_id
    ignored = [line for line in lines if "not written by this run" in line]
    assert len(ignored) == 1 and "ignoring 3 checkpoint(s)" in ignored[0], ignored
    assert all(os.path.basename(p) in ignored[0] for p in theirs)
    assert fresh.iter == 9 and params_finite(fresh)
    assert {p: run_id_of(p) for p in theirs} == theirs  # the older files are untouched


def test_sigkill_then_resume_keeps_the_run_id_and_its_earlier_checkpoints_stay_restore_points(tmp_path):
    wd = str(tmp_path)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "kill_worker_mmcv1.py"), wd, "lineage"], cwd=HERE,
                          timeout=300, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    files = {os.path.basename(p): run_id_of(p) for p in pth(wd)}
    assert sorted(files) == ["iter_4.pth", "iter_8.pth"] and len(set(files.values())) == 1
    run_id = files["iter_8.pth"]

    r = build_runner(wd, runner="iter", amp=dict(init_scale=512.0), max_iters=12, guard=NO_CONFIRM,
                     checkpoint=dict(interval=4))
    # MMCV 1.x resumes at meta['iter'], iteration 8's own 0-based counter: iteration 8 runs again, so the start
    # state (the resumed one) counts 7 completed iterations, and CheckpointHook (before the guard) saves iter_8.pth
    # again. Iteration 8 is poisoned on two passes: the start state, then the disk, where iter_8.pth now holds the
    # poisoned save (skipped as non-finite, rewritten after the recovery) and iter_4.pth, written by the killed
    # process, is taken.
    r.register_hook(PoisonEveryPass(8, 2), priority="NORMAL")
    lines = watch(r)
    r.resume(os.path.join(wd, "latest.pth"), map_location="cpu")
    run(r)
    guard = guard_hook(r).guard
    assert guard.run_id == run_id
    recs = divergences(wd)
    assert [r_["iteration"] for r_ in recs] == [8, 8]
    assert [r_["restored_from"] for r_ in recs] == [{"source": "start", "iteration": 7},
                                                     {"source": os.path.join(wd, "iter_4.pth"), "iteration": 4}]
    assert not [line for line in lines if "not written by this run" in line]
    assert [line for line in lines if "skipping checkpoint" in line and "iter_8.pth" in line]
    assert all(run_id_of(p) == run_id and finite_file(p) for p in pth(wd))
    assert r.iter == 12 and params_finite(r)


@pytest.mark.parametrize("fault", [
    dict(kind="weights", iters=[10], value="nan"),  # seen by the step itself (grad_norm, then the weights)
    dict(kind="weights", iters=[10], value="nan", param="net.img_backbone.norm.running_mean"),  # seen at the save
])
def test_fault_on_a_checkpoint_iteration_without_an_earlier_checkpoint_recovers(tmp_path, fault):
    wd = str(tmp_path)
    # The guard's defaults: nothing is confirmed before iteration 51. CheckpointHook runs before the guard, so
    # iter_10.pth is first written from the poisoned state, then rewritten from the restored one.
    r = build_runner(wd, runner="iter", max_iters=12, guard=dict(), checkpoint=dict(interval=10), faults=[fault])
    run(r)
    (rec,) = divergences(wd)
    assert rec["iteration"] == 10
    assert rec["restored_from"]["source"] in ("memory", "start") and rec["restored_from"]["iteration"] < 10
    assert r.iter == 12 and params_finite(r)
    assert [os.path.basename(p) for p in pth(wd)] == ["iter_10.pth", "iter_12.pth"]
    assert all(finite_file(p) for p in pth(wd))
    assert os.path.realpath(os.path.join(wd, "latest.pth")) == os.path.realpath(os.path.join(wd, "iter_12.pth"))
