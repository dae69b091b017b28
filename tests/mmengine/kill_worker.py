"""Trains until a checkpoint is written, then SIGKILLs itself (no cleanup).

Usage: ``python kill_worker.py WORK_DIR [recovery|lineage]``. ``recovery`` (the default): a planted fault is
recovered at iteration 12, ``iter_15.pth`` is written, the kill comes at 17. ``lineage``: no fault,
``iter_4.pth`` and ``iter_8.pth`` are written, the kill comes right after the second.
"""
import os
import signal
import sys

from harness import build_runner
from mmengine.hooks import Hook
from mmengine.registry import HOOKS


@HOOKS.register_module(force=True)
class SigkillHook(Hook):
    priority = "LOWEST"  # after CheckpointHook has written its file

    def __init__(self, at_iter: int) -> None:
        self.at_iter = at_iter

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        if runner.iter + 1 == self.at_iter:
            os.kill(os.getpid(), signal.SIGKILL)


MODES = {
    # NaN written twice: the first rolled back alone (issue 43), the second climbs the ladder to the known fix.
    "recovery": dict(faults=[dict(kind="weights", iters=[12, 14], value="nan")], checkpoint=dict(interval=15),
                     extra_hooks=[dict(type="SigkillHook", at_iter=17)]),
    "lineage": dict(checkpoint=dict(interval=4), extra_hooks=[dict(type="SigkillHook", at_iter=8)]),
}

if __name__ == "__main__":
    work_dir = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "recovery"
    runner = build_runner(work_dir, amp="dynamic", max_iters=40, model_kwargs=dict(num_layers=1, num_query=16),
                          guard=dict(snapshot_interval=5, confirm_steps=3, check_interval=5), **MODES[mode])
    runner.train()
    sys.exit(3)  # never reached: the kill comes first
