"""Run lineage on a real MMEngine runner (issue 13): a rollback stays inside its own run.

A fresh run in a work dir that holds an older run's later checkpoints never restores them; a run resumed after a
SIGKILL keeps its run id, so its own earlier checkpoints stay rollback targets; a fault on a checkpoint iteration
with no earlier checkpoint recovers from the run's own in-memory state. Faults are planted at fixed iterations
(1-based, as logged). The disk is the last restore point (docs/how-it-works.md, "Restore points"): to reach it,
one iteration is poisoned on several passes in a row (``PoisonEveryPass``: the fire drill's faults fire once per
iteration number) where the start state is the only in-memory point, so the second pass reaches the disk. At most
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
from harness import build_runner, guard_hook, params_finite
from mmengine.hooks import Hook
from mmengine.logging import MMLogger
from mmengine.registry import HOOKS

from petr_stability import read_incidents
from petr_stability.adapters.mmengine_runner.checkpoints import load_mmengine_checkpoint as safe_load
from petr_stability.core.faults import poison_weights

__all__ = []

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = dict(num_layers=1, num_query=16)
#: No snapshot is ever confirmed: an incident chain never ends, so no restore point is tried twice. No replay of
#: the failing batch: its cause classification (data, dynamics, ...) is not what these tests are about.
NO_CONFIRM = dict(snapshot_interval=1000, confirm_steps=1000, check_interval=1000, max_recoveries=10,
                  diagnose=False)
#: A dynamic loss scale starting at 2**30 overflows for its first ~20 iterations on this model while it
#: calibrates (README: "the run of ~14 overflows while init_scale=2**30 calibrates"): no step is applied, so no
#: snapshot is taken and the run's start state is its only in-memory restore point.
CALIBRATING = dict(init_scale=2.0 ** 30)


@HOOKS.register_module(force=True)
class PoisonEveryPass(Hook):
    """Plants NaN in the weights each of the first ``passes`` times iteration ``at`` (1-based) starts."""

    def __init__(self, at, passes):
        self.at, self.left = at, passes

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter + 1 == self.at and self.left > 0:
            self.left -= 1
            poison_weights(runner.model)


def poisoned_passes(iteration, passes):
    return [dict(type="PoisonEveryPass", at=iteration, passes=passes)]


class Captured(logging.Handler):
    """Keeps every message written to MMEngine's current logger during a test."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    handler = Captured()
    attached = []

    def attach(runner):
        logger = runner.logger if hasattr(runner, "logger") else MMLogger.get_current_instance()
        logger.addHandler(handler)
        attached.append(logger)

    handler.attach = attach
    yield handler
    for logger in attached:
        logger.removeHandler(handler)


def divergences(work_dir):
    return [r for r in read_incidents(work_dir) if r["event"] == "divergence"]


def pth(work_dir):
    return sorted(p for p in glob.glob(os.path.join(work_dir, "**", "*.pth"), recursive=True)
                  if not os.path.islink(p))


def finite_file(path):
    ckpt = safe_load(path)
    return all(bool(torch.isfinite(v).all()) for v in ckpt["state_dict"].values() if v.is_floating_point())


def test_fresh_run_beside_an_older_runs_later_checkpoints_recovers_from_its_own_state(tmp_path, log_lines):
    wd = str(tmp_path)
    older = build_runner(wd, max_iters=20, model_kwargs=SMALL, guard=dict(snapshot_interval=5, confirm_steps=3),
                         checkpoint=dict(interval=7))
    older.train()
    theirs = {p: safe_load(p)["nan_guard"]["run_id"] for p in pth(wd)}
    assert sorted(os.path.basename(p) for p in theirs) == ["iter_14.pth", "iter_20.pth", "iter_7.pth"]

    # A new run in the same work dir (MMEngine's default work_dirs/<config name>) diverges at iteration 7, twice:
    # the first pass takes the start state, the second reaches the disk. Its own files are iter_2/4/6; the older
    # iter_7.pth is newer than any of them and not beyond iteration 7: only its run id rules it out.
    fresh = build_runner(wd, amp=CALIBRATING, max_iters=9, model_kwargs=SMALL, guard=NO_CONFIRM,
                         checkpoint=dict(interval=2), hooks_before_guard=poisoned_passes(7, 2))
    log_lines.attach(fresh)
    fresh.train()
    guard = guard_hook(fresh).guard
    assert guard.run_id not in set(theirs.values())
    recs = divergences(wd)
    assert [r["iteration"] for r in recs] == [7, 7]
    assert [r["restored_from"] for r in recs] == [{"source": "start", "iteration": 0},
                                                   {"source": os.path.join(wd, "iter_6.pth"), "iteration": 6}]
    assert safe_load(os.path.join(wd, "iter_6.pth"))["nan_guard"]["run_id"] == guard.run_id
    ignored = [line for line in log_lines.lines if "not written by this run" in line]
    assert len(ignored) == 1 and "ignoring 3 checkpoint(s)" in ignored[0], ignored
    assert all(os.path.basename(p) in ignored[0] for p in theirs)
    assert fresh.iter == 9 and params_finite(fresh)
    assert {p: safe_load(p)["nan_guard"]["run_id"] for p in theirs} == theirs  # the older files are untouched


def test_sigkill_then_resume_keeps_the_run_id_and_its_earlier_checkpoints_stay_restore_points(tmp_path, log_lines):
    wd = str(tmp_path)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "kill_worker.py"), wd, "lineage"], cwd=HERE,
                          timeout=300, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    files = {os.path.basename(p): safe_load(p)["nan_guard"]["run_id"] for p in pth(wd)}
    assert sorted(files) == ["iter_4.pth", "iter_8.pth"] and len(set(files.values())) == 1
    run_id = files["iter_8.pth"]

    # Resumed from iter_8 (last_checkpoint). Iteration 9, the first one after the resume (no snapshot yet), is
    # poisoned on three passes: the start state (the resumed one), then iter_8.pth, then iter_4.pth, both
    # written by the killed process.
    runner = build_runner(wd, max_iters=12, model_kwargs=SMALL, guard=NO_CONFIRM, checkpoint=dict(interval=4),
                          resume=True, hooks_before_guard=poisoned_passes(9, 3))
    log_lines.attach(runner)
    runner.train()
    guard = guard_hook(runner).guard
    assert guard.run_id == run_id
    recs = divergences(wd)
    assert [r["restored_from"] for r in recs] == [{"source": "start", "iteration": 8},
                                                   {"source": os.path.join(wd, "iter_8.pth"), "iteration": 8},
                                                   {"source": os.path.join(wd, "iter_4.pth"), "iteration": 4}]
    assert not [line for line in log_lines.lines if "not written by this run" in line]
    assert safe_load(os.path.join(wd, "iter_12.pth"))["nan_guard"]["run_id"] == run_id
    assert runner.iter == 12 and params_finite(runner)


@pytest.mark.parametrize("fault", [
    dict(kind="weights", iters=[10], value="nan"),  # seen by the step itself (grad_norm, then the weights)
    dict(kind="weights", iters=[10], value="nan", param="net.img_backbone.norm.running_mean"),  # seen at the save
])
def test_fault_on_a_checkpoint_iteration_without_an_earlier_checkpoint_recovers(tmp_path, fault):
    wd = str(tmp_path)
    runner = build_runner(wd, max_iters=12, model_kwargs=SMALL, guard=dict(), checkpoint=dict(interval=10),
                          faults=[fault])  # the guard's defaults: nothing is confirmed before iteration 51
    runner.train()
    (rec,) = divergences(wd)
    assert rec["iteration"] == 10
    assert rec["restored_from"]["source"] in ("memory", "start") and rec["restored_from"]["iteration"] < 10
    assert runner.iter == 12 and params_finite(runner)
    # iter_10.pth was written from the restored state, then again at iteration 10; save_last adds iter_12.
    assert [os.path.basename(p) for p in pth(wd)] == ["iter_10.pth", "iter_12.pth"]
    assert all(finite_file(p) for p in pth(wd))
    with open(os.path.join(wd, "last_checkpoint"), encoding="utf-8") as f:
        assert os.path.basename(f.read().strip()) == "iter_12.pth"


def test_a_rollback_to_the_start_state_writes_no_checkpoint_the_interval_did_not_ask_for(tmp_path):
    wd = str(tmp_path)
    runner = build_runner(wd, amp=CALIBRATING, max_iters=6, model_kwargs=SMALL, guard=NO_CONFIRM,
                          faults=[dict(kind="weights", iters=[3], value="nan")])  # checkpoint interval 10**6
    runner.train()
    (rec,) = divergences(wd)
    assert rec["restored_from"] == {"source": "start", "iteration": 0}
    assert runner.iter == 6 and params_finite(runner)
    assert [os.path.basename(p) for p in pth(wd)] == ["iter_6.pth"]  # save_last only
