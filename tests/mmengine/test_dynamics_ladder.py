"""A too-high learning rate, nothing planted: the guarded MMEngine run (CPU fp16) climbs the dynamics ladder.

The harness model (one PETR decoder layer, 16 queries) at a peak lr of 0.2 (1000x the harness's 2e-4): the attention
logits grow until fp16 overflows, every step is skipped and the dynamic loss scale falls below 1. Unguarded, the run
stalls there. Guarded, the first incident gets the ladder's first rung (the known manual fix (transformer dropout 0,
max_norm 1)), which does not hold; the second gets the learning-rate rung (every group and schedule x
``lr_backoff``, here 0.1: at 0.5, and at 0.25 once the skip-streak rule caught the divergence sooner, the
reduced rate still diverged on torch's portable CPU kernels, ATEN_CPU_CAPABILITY=default), which holds; the run
finishes with finite weights.

``diagnose=False``: with the replay on, this overflow is classed ``forward_overflow`` (the decoder layer re-run in
fp32 is finite) and its remedy is that layer in fp32, not the ladder (docs/demo.md measures both). Without a
replay the class is ``unknown``, which takes the ladder as ``dynamics`` does.
"""
import pytest
import torch
from harness import build_runner, guard_hook, params_finite

from petr_stability.core.records import read_incidents
from petr_stability.core.recovery.policy import LADDER

# fp16 overflows and skipped steps land where the CPU kernels round: these run again under ATEN_CPU_CAPABILITY=default.
pytestmark = pytest.mark.numerics

__all__ = []

LR = 0.2
ITERS = 30
MODEL = dict(num_layers=1, num_query=16)
GUARD = dict(snapshot_interval=5, confirm_steps=8, check_interval=2, diagnose=False, lr_backoff=0.1)


def _state_finite(runner) -> bool:
    model = runner.model.module if hasattr(runner.model, "module") else runner.model
    return all(bool(torch.isfinite(t).all()) for t in list(model.parameters()) + list(model.buffers())
               if t.is_floating_point())


def test_unguarded_run_stalls(tmp_path):
    runner = build_runner(str(tmp_path), max_iters=ITERS, lr=LR, model_kwargs=MODEL)
    runner.train()
    # The loss scaler kept the weights finite, but its scale fell below 1: every late step is skipped.
    assert runner.optim_wrapper.loss_scaler.get_scale() < 1.0
    assert params_finite(runner)


def test_guarded_run_climbs_to_the_lr_rung_and_finishes(tmp_path):
    runner = build_runner(str(tmp_path), max_iters=ITERS, lr=LR, model_kwargs=MODEL, guard=GUARD)
    runner.train()
    assert runner.iter == ITERS and _state_finite(runner)
    assert runner.optim_wrapper.loss_scaler.get_scale() >= 1.0

    records = [r for r in read_incidents(str(tmp_path)) if r["event"] == "divergence"]
    assert len(records) >= 2, records
    assert all(r["cause"]["cause"] in ("dynamics", "unknown") for r in records)
    targets = [{a["target"]: a for a in r["actions"]} for r in records]
    # Rung 1 at the first incident: the known manual fix.
    assert targets[0]["optim_wrapper.clip_grad.max_norm"]["new"] == 1.0
    assert any(t.endswith("dropout_layer.p") and a["new"] == 0.0 for t, a in targets[0].items())
    # Rung 2 at the next incident of the chain: the learning rate x lr_backoff, in the group and in the schedule.
    lr_step = next(i for i, t in enumerate(targets) if "optimizer0.group0.lr" in t)
    assert lr_step == 1
    group = targets[lr_step]["optimizer0.group0.lr"]
    assert group["new"] == pytest.approx(group["old"] * GUARD["lr_backoff"])
    schedule = targets[lr_step]["LinearLR.base_values"]
    assert schedule["new"] == pytest.approx([v * GUARD["lr_backoff"] for v in schedule["old"]])
    assert records[lr_step]["restored_from"] is not None

    guard = guard_hook(runner).guard
    assert guard.remedy("lr").lr_factor == GUARD["lr_backoff"]
    # The schedule continued scaled: past the warm-up the lr is the backed-off peak.
    assert runner.optim_wrapper.optimizer.param_groups[0]["lr"] == pytest.approx(LR * GUARD["lr_backoff"])
    held = [i["held"]["rung"] for i in guard.policy.history.incidents if i.get("held")]
    assert held == [LADDER[1].name], guard.policy.history.incidents


def test_a_rewarmed_rate_is_given_back_and_backed_off_again_when_trouble_returns(tmp_path):
    """``lr_rewarm=5``: after the lr rung held, 5 healthy iterations give the schedule's own rate back (x 1 /
    ``lr_backoff``, never above it). At this rate the trouble returns: a new chain, whose first rung is in force,
    climbs to the lr rung again, and every later re-warm waits twice as long as the one before."""
    iters = 45
    runner = build_runner(str(tmp_path), max_iters=iters, lr=LR, model_kwargs=MODEL, guard=dict(GUARD, lr_rewarm=5))
    runner.train()
    assert runner.iter == iters and _state_finite(runner)
    guard = guard_hook(runner).guard
    lr = guard.remedy("lr")
    assert lr.lr_rewarms, "no re-warm"
    assert all(r["to"] == pytest.approx(min(1.0, r["from"] / GUARD["lr_backoff"])) for r in lr.lr_rewarms)
    records = [r for r in read_incidents(str(tmp_path)) if r["event"] == "divergence"]
    backoffs = [r for r in records if any(a["target"] == "optimizer0.group0.lr" and a["new"] < a["old"]
                                          for a in r["actions"])]
    assert len(backoffs) >= 2, "the trouble did not return after a re-warm"  # at LR 0.2 it does, on both kernel sets
    assert lr.lr_rewarm_wait == 5 * 2 ** (len(backoffs) - 1)
    # Each re-warm scaled the schedule with the groups: past the warm-up the rate is the schedule's x the factor.
    assert runner.optim_wrapper.optimizer.param_groups[0]["lr"] == pytest.approx(LR * lr.lr_factor)
    assert guard.summary()["lr_rewarms"] == lr.lr_rewarms
