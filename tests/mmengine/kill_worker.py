"""Trains until a planted fault is recovered and a checkpoint is written, then SIGKILLs itself (no cleanup)."""
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


if __name__ == "__main__":
    work_dir = sys.argv[1]
    runner = build_runner(work_dir, amp="dynamic", max_iters=40, model_kwargs=dict(num_layers=1, num_query=16),
                          guard=dict(snapshot_interval=5, confirm_steps=3, check_interval=5),
                          faults=[dict(kind="weights", iters=[12], value="nan")], checkpoint=dict(interval=15),
                          extra_hooks=[dict(type="SigkillHook", at_iter=17)])
    runner.train()
    sys.exit(3)  # never reached: the kill comes first
