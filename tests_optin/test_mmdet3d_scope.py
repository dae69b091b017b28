"""Opt-in (needs mmcv built with its compiled ops: `bash scripts/setup_full_mmcv.sh && make test-mmdet3d-scope`).

A real Runner under ``default_scope='mmdet3d'`` builds NanGuardHook and FaultInjectionHook through mmdet3d's
registries (which import mmdet3d.engine, and so mmcv's compiled ops) and recovers from poisoned weights.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "mmengine"))

import mmcv.ops  # noqa: E402,F401  (fails loudly without the compiled ops: this suite needs them)
import torch  # noqa: E402
from harness import build_runner, params_finite  # noqa: E402

import petr_stability  # noqa: E402
from petr_stability import read_incidents  # noqa: E402


def test_runner_under_mmdet3d_scope_recovers(tmp_path):
    import mmdet3d.models  # noqa: F401  (the model zoo imports: the point of this environment)
    from mmdet3d.registry import HOOKS

    runner = build_runner(str(tmp_path), amp="dynamic", max_iters=30, default_scope="mmdet3d",
                          model_kwargs=dict(num_layers=1, num_query=16),
                          guard=dict(snapshot_interval=5, confirm_steps=3, check_interval=5),
                          faults=[dict(kind="weights", iters=[20], value="nan")])
    guard = [h for h in runner.hooks if type(h).__name__ == "NanGuardHook"]
    assert len(guard) == 1 and isinstance(guard[0], petr_stability.NanGuardHook)
    assert HOOKS.get("NanGuardHook") is petr_stability.NanGuardHook
    runner.train()
    assert runner.iter == 30 and params_finite(runner)
    assert [r["iteration"] for r in read_incidents(str(tmp_path))] == [20]
    assert torch.isfinite(torch.tensor(read_incidents(str(tmp_path))[0]["signals"]["loss"]))
