"""The CUDA path as users run it: MMEngine's *unmodified* AmpOptimWrapper, fp16 autocast on the GPU.

Run on a GPU machine: `python -m pytest -m cuda tests/cuda` (benchmarks/gpu_check.sh does it). Skipped, with the
reason, where no GPU is present or MMEngine is not installed; see cuda_profile.py for the CPU rehearsal.
"""
import os
import sys

import pytest

from petr_stability.testing.stacks import require

require("mmengine")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "mmengine"))
from cuda_profile import MARKS, PROFILE  # noqa: E402

pytestmark = MARKS

SMALL = dict(num_layers=1, num_query=16)
GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)


def _runner(tmp_path, loss_scale, faults, max_iters=30, guard=GUARD):
    from harness import build_runner

    # MMEngine's own AmpOptimWrapper (CUDA GradScaler, CUDA autocast), built from the config as users build it.
    return build_runner(str(tmp_path), amp=loss_scale, amp_type=PROFILE.mmengine_amp, max_iters=max_iters,
                        guard=guard, model_kwargs=SMALL, faults=faults)


@pytest.mark.parametrize("loss_scale", ["dynamic", 512.0])
def test_poisoned_weights_recover_on_cuda(tmp_path, loss_scale):
    from harness import guard_hook, params_finite

    from petr_stability import read_incidents

    # NaN written twice: the first rolled back alone (issue 43), the second gets the known manual fix.
    runner = _runner(tmp_path, loss_scale, [dict(kind="weights", iters=[20, 22], value="nan")])
    runner.train()
    assert type(runner.optim_wrapper).__name__ == PROFILE.mmengine_amp
    assert next(runner.model.parameters()).device.type == PROFILE.device
    assert runner.iter == 30 and params_finite(runner)
    alone, rec = read_incidents(str(tmp_path))
    assert alone["cause"]["signals"].get("rollback_alone") is True and alone["actions"] == []
    assert rec["event"] == "divergence" and rec["restored_from"]["source"] == "memory"
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 1.0
    assert guard_hook(runner).guard.recoveries == 2
    # On a GPU the restored snapshot was copied into pinned host memory (asynchronous copies).
    snap = guard_hook(runner).guard.points.ring.newest_confirmed()
    assert snap is not None and snap.payload["state_dict"]
    pinned = [t.is_pinned() for t in snap.payload["state_dict"].values()]
    assert all(pinned) if PROFILE.on_gpu else not any(pinned)


def test_harmless_overflow_changes_nothing_on_cuda(tmp_path):
    from harness import guard_hook

    from petr_stability import read_incidents

    runner = _runner(tmp_path, dict(init_scale=512.0), [dict(kind="grads", iters=[15], value="inf")])
    runner.train()
    assert guard_hook(runner).guard.recoveries == 0 and read_incidents(str(tmp_path)) == []
    assert guard_hook(runner).guard.skipped_steps >= 1
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 35
    assert runner.optim_wrapper.loss_scaler.get_scale() < 512.0  # the scaler backed off: a real skipped step


def test_healthy_step_and_snapshot_copies_add_no_host_device_sync(tmp_path, monkeypatch):
    from harness import guard_hook

    import petr_stability.core.recovery.restore as guard_module
    from petr_stability.testing.reads import watch_healthy_steps, watch_methods

    runner = _runner(tmp_path, "dynamic", [], max_iters=24,
                     guard=dict(snapshot_interval=4, confirm_steps=3, check_interval=1000))
    calls = watch_healthy_steps(guard_hook(runner), snapshot_interval=4, recorder=PROFILE.recorder)
    # The snapshot's copies themselves: pinned memory, non-blocking, no wait.
    monkeypatch.setattr(guard_module, "copy_to_host", guard_module.copy_to_host)  # the original comes back after
    copies = watch_methods(guard_module, ["copy_to_host"], when=lambda payload: True, recorder=PROFILE.recorder)
    runner.train()
    assert len(calls) >= 2 * 10 and len(copies) >= 5
    assert [s for call in calls + copies for s in call] == []
