"""The CUDA path as users run it: MMEngine's *unmodified* AmpOptimWrapper, fp16 autocast on the GPU.

Run on a GPU machine: `python -m pytest -m cuda tests/cuda` (benchmarks/gpu_check.sh does it). Skipped, with the
reason, where no GPU is present.
"""
import os
import sys
import warnings

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mmengine"))

SMALL = dict(num_layers=1, num_query=16)
GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)


def _runner(tmp_path, loss_scale, faults, max_iters=30, guard=GUARD):
    from harness import build_runner

    runner = build_runner(str(tmp_path), amp=None, max_iters=max_iters, guard=guard, model_kwargs=SMALL,
                          faults=faults)
    # Swap in MMEngine's own AmpOptimWrapper (CUDA GradScaler, CUDA autocast), built as a config would build it.
    from mmengine.optim import build_optim_wrapper

    runner.optim_wrapper = build_optim_wrapper(runner.model, dict(
        type="AmpOptimWrapper", loss_scale=loss_scale, clip_grad=dict(max_norm=35, norm_type=2),
        optimizer=dict(type="AdamW", lr=2e-4, weight_decay=0.01)))
    return runner


@pytest.mark.parametrize("loss_scale", ["dynamic", 512.0])
def test_poisoned_weights_recover_on_cuda(tmp_path, loss_scale):
    from harness import params_finite

    from petr_stability import read_incidents

    runner = _runner(tmp_path, loss_scale, [dict(kind="weights", iters=[20], value="nan")])
    runner.train()
    assert next(runner.model.parameters()).is_cuda
    assert runner.iter == 30 and params_finite(runner)
    assert [r["event"] for r in read_incidents(str(tmp_path))] == ["divergence"]
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 1.0


def test_harmless_overflow_changes_nothing_on_cuda(tmp_path):
    from harness import guard_hook

    from petr_stability import read_incidents

    runner = _runner(tmp_path, dict(init_scale=512.0), [dict(kind="grads", iters=[15], value="inf")])
    runner.train()
    assert guard_hook(runner).guard.recoveries == 0 and read_incidents(str(tmp_path)) == []
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 35


def test_healthy_step_adds_no_host_device_sync(tmp_path):
    from harness import guard_hook

    # No periodic check, no snapshot due in the watched iterations: what remains is the per-step path.
    runner = _runner(tmp_path, "dynamic", [], max_iters=24,
                     guard=dict(snapshot_interval=1000, confirm_steps=3, check_interval=1000))
    hook = guard_hook(runner)
    caught = []
    original = hook.after_train_iter

    def watched(r, batch_idx, data_batch=None, outputs=None):
        if r.iter < 12 or hook.guard.ring.snapshots == []:  # warm-up and the first snapshot are not watched
            return original(r, batch_idx, data_batch, outputs)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                original(r, batch_idx, data_batch, outputs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        caught.extend(str(x.message) for x in w if "synchroniz" in str(x.message))

    hook.after_train_iter = watched
    runner.train()
    assert caught == []
