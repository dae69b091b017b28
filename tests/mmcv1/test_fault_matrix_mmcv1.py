"""The fault matrix (issue 6) on real MMCV 1.x runners: each case finishes, or stops with the plugin's own error,
and no poisoned state is restored or left as the last checkpoint.

Covered here: a fault before any healthy state exists, a truncated checkpoint on disk, a SIGKILL after a recovery
followed by a resume, and gradient accumulation (``GradientCumulativeOptimizerHook`` and its fp16 variant).
"""
import glob
import logging
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
from harness import build_runner, guard_hook, opt_hook, params_finite, run
from kill_worker_mmcv1 import FAULT_ITER, GUARD, KILL_ITER
from mmcv.runner import GradientCumulativeOptimizerHook, Hook, OptimizerHook

from petr_stability import read_incidents, safe_load
from petr_stability.core.tree import iter_tensors
from petr_stability.core.watch.health import all_finite
from petr_stability.testing.mmcv1_cpu import CPUGradientCumulativeFp16OptimizerHook

HERE = os.path.dirname(os.path.abspath(__file__))
DYN = dict(init_scale=512.0)  # a dynamic scale with no calibration overflows on this model
FAST = GUARD


def ckpt_finite(path):
    return all_finite(iter_tensors(safe_load(path, extra_globals=())))


def transformer_dropouts(r):
    layer = r.model.net.pts_bbox_head.layers[0]
    return [m.p for m in layer.modules() if isinstance(m, torch.nn.Dropout)]


def pth_files(work_dir):
    return sorted(glob.glob(os.path.join(work_dir, "*.pth")))


# ------------------------------------------------------------------ no healthy state yet
@pytest.mark.parametrize("fault_iter", [1, 2])  # 1: no snapshot at all; 2: a snapshot, but not yet confirmed
def test_fault_before_any_confirmed_state_recovers_from_the_runs_own_state(tmp_path, fault_iter):
    # A checkpoint is written on the failing iteration itself, from the poisoned state: it is rewritten from the
    # restored state, and the run finishes (it used to stop with NoHealthyStateError).
    wd = str(tmp_path)
    r = build_runner(wd, runner="iter", amp=DYN, max_iters=6, guard=FAST,
                     faults=[dict(kind="weights", iters=[fault_iter])], checkpoint=dict(interval=fault_iter))
    run(r)
    assert r.iter == 6 and params_finite(r)
    (rec,) = read_incidents(wd)
    expected = {"source": "start", "iteration": 0} if fault_iter == 1 else {"source": "memory", "iteration": 1}
    assert rec["event"] == "divergence" and rec["iteration"] == fault_iter and rec["restored_from"] == expected
    assert pth_files(wd) and all(ckpt_finite(p) for p in pth_files(wd))


# ------------------------------------------------------------------ truncated checkpoint on disk
class TruncateOnce(Hook):
    """Cuts a checkpoint file in half once, after the iteration that wrote it (a node died while writing)."""

    def __init__(self, at_iter, name):
        self.at_iter, self.name, self.done = at_iter, name, False

    def after_train_iter(self, runner):
        if runner.iter + 1 == self.at_iter and not self.done:
            self.done = True
            path = os.path.join(runner.work_dir, self.name)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)


def test_a_truncated_checkpoint_on_disk_is_not_read_while_memory_holds_a_state(tmp_path, caplog):
    # The restore order puts this run's unconfirmed snapshots before any file (the core suite covers a truncated
    # file being skipped when the disk is reached). Iteration 12 is not replayed, so its truncated file stays.
    wd = str(tmp_path)
    r = build_runner(wd, runner="iter", amp=DYN, max_iters=16, guard=dict(FAST, confirm_steps=1000),
                     faults=[dict(kind="weights", iters=[13])], checkpoint=dict(interval=4))
    r.register_hook(TruncateOnce(12, "iter_12.pth"), priority="LOWEST")
    with caplog.at_level(logging.WARNING):
        run(r)
    assert not [m for m in caplog.records if "skipping checkpoint" in m.getMessage()]
    (rec,) = read_incidents(wd)
    assert rec["event"] == "divergence" and rec["iteration"] == 13
    assert rec["restored_from"] == {"source": "memory", "iteration": 12} and rec["iterations_lost"] == 1
    assert guard_hook(r).guard.recoveries == 1 and r.iter == 16 and params_finite(r)
    names = [os.path.basename(p) for p in pth_files(wd)]
    assert names == ["iter_12.pth", "iter_16.pth", "iter_4.pth", "iter_8.pth", "latest.pth"]
    assert all(ckpt_finite(p) for p in pth_files(wd) if not p.endswith("iter_12.pth"))


# ------------------------------------------------------------------ SIGKILL after a recovery, then resume
class FirstIterRecorder(Hook):
    """Records the live remedies as the first resumed iteration starts (after every before_run)."""

    def __init__(self):
        self.seen = None

    def before_train_iter(self, runner):
        if self.seen is None:
            self.seen = (runner.iter, opt_hook(runner).grad_clip["max_norm"], transformer_dropouts(runner))


def test_sigkill_after_a_recovery_then_resume_keeps_remedies_and_counters(tmp_path):
    wd = str(tmp_path)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "kill_worker_mmcv1.py"), wd], cwd=HERE,
                          timeout=300, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    rec, second = read_incidents(wd)  # the first rolled back alone, the second with the known manual fix
    assert rec["event"] == "divergence" and rec["iteration"] == FAULT_ITER and second["iteration"] == FAULT_ITER + 1
    # Snapshots after iterations 1, 2, 4 (interval 2); the one of 4 has a single clean step when 6 diverges.
    assert rec["restored_from"] == {"source": "memory", "iteration": 2} and rec["iterations_lost"] == FAULT_ITER - 2
    resume_from = os.path.join(wd, "latest.pth")
    assert os.path.realpath(resume_from) == os.path.join(os.path.realpath(wd), f"iter_{KILL_ITER}.pth")
    saved = safe_load(resume_from, extra_globals=())["meta"]["nan_guard"]
    assert saved["recoveries"] == 2 and saved["remedies"]["dropout"]["dropout_zeroed"]

    r = build_runner(wd, runner="iter", amp=DYN, max_iters=12, guard=GUARD)  # the same run, without the fault
    assert opt_hook(r).grad_clip["max_norm"] == 35 and 0.1 in transformer_dropouts(r)  # a fresh process
    first = FirstIterRecorder()
    r.register_hook(first, priority="LOWEST")
    r.resume(resume_from, map_location="cpu")
    run(r)
    # MMCV 1.x resumes at meta["iter"], the saved iteration's own 0-based counter: iteration 8 runs again.
    assert first.seen == (KILL_ITER - 1, 1.0, [0.0] * len(first.seen[2]))  # remedies live before the first step
    g = guard_hook(r).guard
    assert g.recoveries == 2 and g.remedy("dropout").dropout_zeroed
    assert g.chain.iterations_lost == saved["iterations_lost"] == rec["iterations_lost"] + second["iterations_lost"]
    assert g.skipped_steps >= saved["skipped_steps"] and g.chain.actions_tried[:len(saved["actions_tried"])] == saved[
        "actions_tried"]
    assert opt_hook(r).grad_clip["max_norm"] == 1.0 and set(transformer_dropouts(r)) == {0.0}
    assert r.iter == 12 and params_finite(r) and len(read_incidents(wd)) == 2
    assert ckpt_finite(os.path.join(wd, "latest.pth"))


# ------------------------------------------------------------------ gradient accumulation
def use_optimizer_hook(r, hook):
    """Puts ``hook`` where the runner's OptimizerHook is, at its priority."""
    i = next(i for i, h in enumerate(r.hooks) if isinstance(h, OptimizerHook))
    hook.priority = r.hooks[i].priority
    r.hooks[i] = hook


class StepRecorder(Hook):
    """After the guard: (1-based iteration, loss, guard's skipped steps, a copy of the parameters)."""

    def __init__(self):
        self.rows = []

    def after_train_iter(self, runner):
        g = guard_hook(runner).guard
        params = [p.detach().clone() for p in runner.model.parameters()]
        self.rows.append((runner.iter + 1, runner.outputs["log_vars"]["loss"], g.skipped_steps, params))


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_accumulation_nan_loss_on_a_non_stepping_iteration_is_one_skipped_step(tmp_path, fp16):
    # cumulative_iters=4: the optimizer steps on iterations 4, 8, 12; the NaN loss of iteration 6 reaches the
    # weights only through the gradient summed up to iteration 8, which must be skipped, not applied.
    wd = str(tmp_path)
    r = build_runner(wd, runner="iter", amp=None, max_iters=12, guard=dict(FAST, check_interval=1),
                     faults=[dict(kind="loss", iters=[6], value="nan")])
    clip = dict(max_norm=35, norm_type=2)
    hook = (CPUGradientCumulativeFp16OptimizerHook(loss_scale=DYN, cumulative_iters=4, grad_clip=clip) if fp16
            else GradientCumulativeOptimizerHook(cumulative_iters=4, grad_clip=clip))
    use_optimizer_hook(r, hook)
    rec = StepRecorder()
    r.register_hook(rec, priority="LOWEST")
    run(r)
    g = guard_hook(r).guard
    assert opt_hook(r) is hook and r.iter == 12
    rows = {it: (loss, skipped, params) for it, loss, skipped, params in rec.rows}
    assert [it for it, *_ in rec.rows] == list(range(1, 13))  # no rollback: every iteration ran once
    assert math.isnan(rows[6][0]) and all(math.isfinite(rows[i][0]) for i in rows if i != 6)  # the fault landed
    # the verdict came on the stepping iteration 8, not on iteration 6 where the NaN loss was seen
    assert [rows[i][1] for i in range(1, 13)] == [0] * 7 + [1] * 5
    assert g.skipped_steps == 1 and g.recoveries == 0
    # fp32 has no loss scaler: the skipped step is an event in the incident log (which step, which batch).
    assert [(r["event"], r["iteration"]) for r in read_incidents(wd)] == ([] if fp16 else [("skip", 8)])
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    assert not same(rows[3][2], rows[4][2])  # iteration 4 stepped
    assert same(rows[4][2], rows[8][2])  # iteration 8's NaN-summed step was dropped
    assert not same(rows[8][2], rows[12][2])  # and training went on at iteration 12
    assert params_finite(r) and not any(p.grad is not None and not torch.isfinite(p.grad).all()
                                        for p in r.model.parameters())
    assert hook.grad_clip["max_norm"] == 35 and 0.1 in transformer_dropouts(r)  # no remedy was applied
    if fp16:
        assert hook.loss_scaler.get_scale() == 256.0  # the scaler backed off once, by itself
