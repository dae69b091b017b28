"""MMCV 1.x: trains until a planted fault is recovered and a checkpoint is written, then SIGKILLs itself.

Usage: ``python kill_worker_mmcv1.py WORK_DIR [recovery|lineage]``. The kill comes after ``CheckpointHook`` wrote
``iter_8.pth`` (priority LOWEST runs last), so no hook gets to clean up or flush anything: what survives is what is
on disk. ``recovery`` (the default): a planted fault at iteration 6 is recovered first. ``lineage``: no fault, and
``iter_4.pth`` is written too.
"""
import os
import signal
import sys
import types

from harness import build_runner, run
from mmcv.runner import Hook, iter_based_runner

#: Shared with the test that resumes the run, so both sides build the same runner.
GUARD = dict(snapshot_interval=2, confirm_steps=2, check_interval=2, patience=2, static_patience=3)
FAULT_ITER, KILL_ITER = 6, 8


class SigkillHook(Hook):
    def after_train_iter(self, runner):
        if runner.iter + 1 == KILL_ITER:
            os.kill(os.getpid(), signal.SIGKILL)


MODES = {
    # NaN written twice: the first rolled back alone (issue 43), the second climbs the ladder to the known fix.
    "recovery": dict(faults=[dict(kind="weights", iters=[FAULT_ITER, FAULT_ITER + 1])],
                     checkpoint=dict(interval=KILL_ITER)),
    "lineage": dict(checkpoint=dict(interval=KILL_ITER // 2)),
}

if __name__ == "__main__":
    iter_based_runner.time = types.SimpleNamespace(sleep=lambda s: None)  # the runner's 1-2 s sleeps
    mode = sys.argv[2] if len(sys.argv) > 2 else "recovery"
    r = build_runner(sys.argv[1], runner="iter", amp=dict(init_scale=512.0), max_iters=12, guard=GUARD,
                     **MODES[mode])
    r.register_hook(SigkillHook(), priority="LOWEST")
    run(r)
    sys.exit(3)  # never reached: the kill comes first
