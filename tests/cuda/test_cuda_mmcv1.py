"""The CUDA path as MMCV 1.x users run it: MMCV's *unmodified* Fp16OptimizerHook (its own CUDA GradScaler),
``wrap_fp16_model`` and ``@auto_fp16`` (CUDA autocast), the model in ``MMDataParallel`` as mmdet's train_detector
puts it.

Run on a GPU machine in an MMCV 1.x environment: `python -m pytest -m cuda tests/cuda` (benchmarks/gpu_check.sh
does it). Skipped, with the reason, where no GPU is present or MMCV 1.x is not installed; see cuda_profile.py
for the CPU rehearsal.
"""
import os
import sys
import types

import pytest

from petr_stability.testing.stacks import require

require("mmcv1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "mmcv1"))
from cuda_profile import MARKS, PROFILE  # noqa: E402

pytestmark = MARKS

GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)


@pytest.fixture(autouse=True)
def _no_runner_sleep(monkeypatch):
    from mmcv.runner import iter_based_runner

    monkeypatch.setattr(iter_based_runner, "time", types.SimpleNamespace(sleep=lambda s: None))


def _runner(tmp_path, loss_scale, faults, max_iters=30, guard=GUARD):
    from harness import build_runner

    return build_runner(str(tmp_path), runner="iter", amp=loss_scale, fp16_type=PROFILE.mmcv1_fp16,
                        device=PROFILE.device, max_iters=max_iters, n_samples=32, guard=guard, faults=faults)


def _module(model):
    return getattr(model, "module", model)


@pytest.mark.parametrize("loss_scale", ["dynamic", 512.0])
def test_poisoned_weights_recover_on_cuda(tmp_path, loss_scale):
    from harness import guard_hook, opt_hook, params_finite, run

    from petr_stability import read_incidents

    # NaN written twice: the first rolled back alone (issue 43), the second gets the known manual fix.
    r = _runner(tmp_path, loss_scale, [dict(kind="weights", iters=[20, 22], value="nan")])
    run(r)
    hook = opt_hook(r)
    assert type(hook).__name__ == PROFILE.mmcv1_fp16 and hook.loss_scaler.is_enabled()
    assert _module(r.model).fp16_enabled  # wrap_fp16_model ran
    assert next(r.model.parameters()).device.type == PROFILE.device
    assert r.iter == 30 and params_finite(r)
    alone, rec = read_incidents(str(tmp_path))
    assert alone["cause"]["signals"].get("rollback_alone") is True and alone["actions"] == []
    assert rec["event"] == "divergence" and rec["restored_from"]["source"] == "memory"
    assert hook.grad_clip["max_norm"] == 1.0 and guard_hook(r).guard.recoveries == 2


def test_harmless_overflow_changes_nothing_on_cuda(tmp_path):
    from harness import guard_hook, opt_hook, run

    from petr_stability import read_incidents

    r = _runner(tmp_path, dict(init_scale=512.0), [dict(kind="grads", iters=[15], value="inf")])
    run(r)
    hook = opt_hook(r)
    assert guard_hook(r).guard.recoveries == 0 and read_incidents(str(tmp_path)) == []
    assert guard_hook(r).guard.skipped_steps >= 1
    assert hook.grad_clip["max_norm"] == 35
    assert hook.loss_scaler.get_scale() < 512.0  # the scaler backed off: a real skipped step


def test_healthy_step_and_snapshot_copies_add_no_host_device_sync(tmp_path, monkeypatch):
    from harness import guard_hook, run

    import petr_stability.core.recovery.restore as guard_module
    from petr_stability.testing.reads import watch_healthy_steps, watch_methods

    r = _runner(tmp_path, "dynamic", [], max_iters=24, guard=dict(snapshot_interval=4, confirm_steps=3,
                                                                   check_interval=1000))
    calls = watch_healthy_steps(guard_hook(r), snapshot_interval=4, recorder=PROFILE.recorder)
    monkeypatch.setattr(guard_module, "copy_to_host", guard_module.copy_to_host)  # the original comes back after
    copies = watch_methods(guard_module, ["copy_to_host"], when=lambda payload: True, recorder=PROFILE.recorder)
    run(r)
    assert len(calls) >= 2 * 10 and len(copies) >= 5
    assert [s for call in calls + copies for s in call] == []
