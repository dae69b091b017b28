"""NanGuardHook in a real MMEngine Runner on the PETR-shaped model (seed layer config), CPU fp16 and fp32."""
import glob
import math
import os
import time

import pytest
import torch
from harness import build_runner, guard_hook, params_finite
from mmengine.config import Config
from mmengine.registry import HOOKS

import petr_stability
from petr_stability import NanGuardGaveUp, UnsafeCheckpointError, read_incidents
from petr_stability.adapters.mmengine_runner.checkpoints import load_mmengine_checkpoint as safe_load
from petr_stability.testing.petr_like import SEED_LAYER_CFG

SMALL = dict(num_layers=1, num_query=16)
GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)


def losses(runner):
    return list(runner.message_hub.get_scalar("train/loss").data[0])


def dropouts(runner):
    head = runner.model.net.pts_bbox_head
    return [m.p for m in head.modules() if isinstance(m, torch.nn.Dropout)] + [
        m.dropout for m in head.modules() if isinstance(m, torch.nn.MultiheadAttention)
    ]


def all_ckpts_finite(work_dir):
    files = glob.glob(os.path.join(work_dir, "*.pth"))
    assert files, "no checkpoint was written"
    for f in files:
        ckpt = safe_load(f)
        assert all(bool(torch.isfinite(v).all()) for v in ckpt["state_dict"].values() if v.is_floating_point()), f
    return files


def test_poisoned_weights_recover_finish_and_checkpoints_stay_finite(tmp_path):
    wd = str(tmp_path)
    cfg = dict(model=dict(type="PETRLikeModel", pts_bbox_head=dict(transformer=dict(decoder=dict(
        transformerlayers=SEED_LAYER_CFG)))), optim_wrapper=dict(clip_grad=dict(max_norm=35, norm_type=2)))
    runner = build_runner(wd, amp="dynamic", max_iters=40, guard=GUARD, model_kwargs=SMALL,
                          faults=[dict(kind="weights", iters=[22, 24], value="nan")],
                          checkpoint=dict(interval=11), cfg=cfg)
    runner.train()
    assert runner.iter == 40 and params_finite(runner)
    # The first NaN written between two steps is rolled back alone (issue 43); the second gets the known manual fix.
    rec, second = read_incidents(wd)
    assert rec["cause"]["signals"]["rollback_alone"] is True and rec["actions"] == []
    assert second["iteration"] == 24 and second["actions"]
    assert rec["event"] == "divergence" and rec["signals"]["weights_finite"] is False
    # PETR's nan_to_num: the poisoned step still logged a finite loss.
    assert math.isfinite(rec["signals"]["loss"])
    assert rec["iteration"] == 22 and rec["signals"]["iteration"] == 22  # one numbering: 1-based, as logged
    assert rec["restored_from"] == {"source": "memory", "iteration": 15}
    assert rec["iterations_lost"] == 7
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 1.0
    assert set(dropouts(runner)) == {0.0}
    assert runner.model.net.img_backbone.drop_path.drop_prob == 0.1  # backbone DropPath untouched
    # It trains on: finite losses after the recoveries, the steps applied (a per-batch loss this noisy, with every
    # grad_norm of ~190 clipped to 1 after the fix, says nothing about progress over 15 iterations).
    hist = losses(runner)
    assert all(math.isfinite(x) for x in hist[-15:]) and guard_hook(runner).guard.skipped_steps < 15
    all_ckpts_finite(wd)
    assert runner.message_hub.get_scalar("train/nan_guard/incidents").current() == 2.0
    # The next run can start from the fix: the run's config, patched, in the work dir.
    patched = Config.fromfile(os.path.join(wd, "nan_guard_patched_config.py"))
    assert patched.optim_wrapper.clip_grad.max_norm == 1.0
    layer = patched.model.pts_bbox_head.transformer.decoder.transformerlayers
    assert [a["dropout"] for a in layer["attn_cfgs"]] == [0, 0] and layer["ffn_dropout"] == 0


def test_one_overflow_and_calibration_overflows_change_nothing(tmp_path):
    runner = build_runner(str(tmp_path), amp=dict(init_scale=2.0 ** 30), max_iters=30, guard=GUARD,
                          model_kwargs=SMALL, faults=[dict(kind="grads", iters=[25], value="inf")])
    before = dropouts(runner)
    assert max(before) == 0.1
    runner.train()
    hook = guard_hook(runner)
    assert hook.guard.skipped_steps >= 12  # calibration from 2**30 plus the planted overflow
    assert hook.guard.recoveries == 0 and read_incidents(str(tmp_path)) == []
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 35
    assert dropouts(runner) == before


def test_fp32_transient_nan_step_is_skipped_and_weights_stay_finite(tmp_path):
    runner = build_runner(str(tmp_path), amp=None, max_iters=20, guard=GUARD, model_kwargs=SMALL,
                          faults=[dict(kind="grads", iters=[12], value="nan")])
    runner.train()
    assert params_finite(runner) and guard_hook(runner).guard.recoveries == 0
    assert guard_hook(runner).guard.skipped_steps == 1


def test_fp32_without_skip_nan_step_is_a_divergence_at_once(tmp_path):
    runner = build_runner(str(tmp_path), amp=None, max_iters=25, guard=dict(GUARD, skip_nonfinite_fp32=False),
                          model_kwargs=SMALL, faults=[dict(kind="grads", iters=[12], value="nan")])
    runner.train()
    (rec,) = read_incidents(str(tmp_path))
    assert rec["iteration"] == 12 and rec["signals"]["scale_mode"] == "none"
    assert params_finite(runner) and runner.iter == 25


def test_unguarded_control_run_is_actually_poisoned(tmp_path):
    # The fault is real: without the hook the same plan leaves NaN weights while the loss stays finite.
    runner = build_runner(str(tmp_path), amp="dynamic", max_iters=30, guard=None, model_kwargs=SMALL,
                          faults=[dict(kind="weights", iters=[22], value="nan")])
    runner.train()
    assert not params_finite(runner)
    assert math.isfinite(losses(runner)[-1])


def test_epoch_loop_fault_on_last_iteration_of_epoch_and_run(tmp_path):
    # 16 samples / batch 2 = 8 iterations per epoch; iteration 8 ends epoch 1. The snapshot of iteration 5 has
    # only 2 of its 3 clean steps then, so the rollback goes to iteration 1 and costs 7 counted iterations: the
    # run's last iteration is counted 24 - 7 = 17.
    wd = str(tmp_path)
    runner = build_runner(wd, amp=dict(init_scale=64.0), max_iters=None, max_epochs=3, n_samples=16, guard=GUARD,
                          model_kwargs=SMALL, checkpoint=dict(interval=1, max_keep_ckpts=1),
                          faults=[dict(kind="weights", iters=[8, 17], value="nan")])
    runner.train()
    assert runner.epoch == 3 and params_finite(runner)
    recs = read_incidents(wd)
    assert [(r["iteration"], r["epoch"]) for r in recs] == [(8, 0), (17, 2)]
    assert recs[0]["iterations_lost"] == 7
    lost = sum(r["iterations_lost"] for r in recs)
    assert runner.iter == 24 - lost  # epochs end with their data; counted iterations come out short
    (only,) = all_ckpts_finite(wd)
    with open(os.path.join(wd, "last_checkpoint")) as f:
        assert os.path.basename(f.read().strip()) == os.path.basename(only)


def test_iter_loop_fault_on_last_iteration_still_ends_healthy(tmp_path):
    wd = str(tmp_path)
    runner = build_runner(wd, amp="dynamic", max_iters=20, guard=GUARD, model_kwargs=SMALL,
                          checkpoint=dict(interval=20, max_keep_ckpts=1),
                          faults=[dict(kind="weights", iters=[20], value="nan")])
    runner.train()
    assert runner.iter == 20 and params_finite(runner)  # max_iters counted steps, after the rollback
    assert read_incidents(wd)[0]["iteration"] == 20
    all_ckpts_finite(wd)


def test_lr_after_rollback_is_the_one_the_restored_counter_implies(tmp_path):
    # LinearLR warms up over 10 iterations: a wrong scheduler state after the rollback shows in the LR.
    # A small initial scale avoids the calibration overflows, so the snapshot at iteration 5 is confirmed.
    clean = build_runner(str(tmp_path / "clean"), amp=dict(init_scale=64.0), max_iters=12, guard=GUARD,
                         model_kwargs=SMALL)
    clean.train()
    lr_clean = list(clean.message_hub.get_scalar("train/lr").data[0])
    bad = build_runner(str(tmp_path / "bad"), amp=dict(init_scale=64.0), max_iters=12, guard=GUARD, model_kwargs=SMALL,
                       faults=[dict(kind="weights", iters=[9], value="nan")])
    bad.train()
    lr_bad = list(bad.message_hub.get_scalar("train/lr").data[0])
    # The history was rolled back with the state: the tail equals the clean run iteration for iteration.
    assert lr_bad[-12:] == pytest.approx(lr_clean[-12:])
    assert read_incidents(str(tmp_path / "bad"))[0]["restored_from"]["iteration"] == 5


def test_resume_keeps_remedies_and_counters(tmp_path):
    wd = str(tmp_path)
    r1 = build_runner(wd, amp="dynamic", max_iters=20, guard=GUARD, model_kwargs=SMALL,
                      checkpoint=dict(interval=20), faults=[dict(kind="weights", iters=[12, 14], value="nan")])
    r1.train()  # the first NaN is rolled back alone (issue 43), the second gets the known manual fix
    r2 = build_runner(wd, amp="dynamic", max_iters=30, guard=GUARD, model_kwargs=SMALL, resume=True)
    r2.train()
    g = guard_hook(r2).guard
    assert g.recoveries == 2 and g.remedy("dropout").dropout_zeroed
    assert r2.optim_wrapper.clip_grad_kwargs["max_norm"] == 1.0
    assert set(dropouts(r2)) == {0.0}
    assert r2.iter == 30


def test_endless_divergence_stops_cleanly_in_bounded_time(tmp_path):
    t0 = time.time()
    runner = build_runner(str(tmp_path), amp="dynamic", max_iters=200, model_kwargs=SMALL,
                          guard=dict(GUARD, max_recoveries=2),
                          faults=[dict(kind="weights", iters=list(range(12, 200)), value="nan")])
    with pytest.raises(NanGuardGaveUp) as err:
        runner.train()
    assert "nan_guard_incidents.jsonl" in str(err.value)
    assert time.time() - t0 < 120
    assert read_incidents(str(tmp_path))[-1]["event"] == "gave_up"


def test_divergence_before_any_snapshot_recovers_from_the_runs_start_state(tmp_path):
    # Iteration 1 is a calibration overflow of the dynamic scale (no snapshot), iteration 2 is poisoned: the only
    # state of this run is the one it started from (issue: such runs used to stop with NoHealthyStateError).
    runner = build_runner(str(tmp_path), amp="dynamic", max_iters=20, guard=GUARD, model_kwargs=SMALL,
                          faults=[dict(kind="weights", iters=[2], value="nan")])
    runner.train()
    (rec,) = read_incidents(str(tmp_path))
    assert rec["restored_from"] == {"source": "start", "iteration": 0} and rec["iterations_lost"] == 2
    assert runner.iter == 20 and params_finite(runner)


def test_no_clip_grad_gets_an_observing_clip(tmp_path):
    runner = build_runner(str(tmp_path), amp="dynamic", max_iters=20, guard=GUARD, model_kwargs=SMALL,
                          clip_grad=None, faults=[dict(kind="weights", iters=[12, 14], value="nan")])
    runner.train()
    # The guard reads every step's norm (the divergences' too); the runner logs none, as without the guard. The
    # first NaN is rolled back alone (issue 43), the second climbs the ladder.
    rec, _ = read_incidents(str(tmp_path))
    assert isinstance(rec["signals"]["grad_norm"], (float, str)) and guard_hook(runner).guard.spikes.count > 0
    assert "train/grad_norm" not in runner.message_hub.log_scalars
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 1.0  # inf -> 1 after the incident
    assert params_finite(runner)


def test_gradient_accumulation_judges_only_stepping_iterations(tmp_path):
    runner = build_runner(str(tmp_path), amp="dynamic", max_iters=24, guard=GUARD, model_kwargs=SMALL,
                          accumulative_counts=2, faults=[dict(kind="loss", iters=[15], value="nan")])
    runner.train()
    # The NaN loss at iteration 15 (no step) poisons the gradient stepped at 16: one harmless skip there.
    g = guard_hook(runner).guard
    assert g.recoveries == 0 and g.skipped_steps >= 1 and params_finite(runner)


def test_loading_a_nonfinite_checkpoint_is_refused(tmp_path):
    wd = str(tmp_path)
    r1 = build_runner(wd, amp="dynamic", max_iters=10, guard=None, model_kwargs=SMALL,
                      checkpoint=dict(interval=10), faults=[dict(kind="weights", iters=[10], value="nan")])
    r1.train()
    r2 = build_runner(str(tmp_path / "b"), amp="dynamic", max_iters=12, guard=GUARD, model_kwargs=SMALL)
    r2._load_from = os.path.join(wd, "iter_10.pth")
    with pytest.raises(UnsafeCheckpointError, match="non-finite"):
        r2.train()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(snapshot_interval=0), "snapshot_interval must be an integer >= 1, got 0"),
        (dict(remedies=["clip", "reboot"]), "remedies: unknown entry 'reboot'"),
        (dict(max_norm=-1), "max_norm must be a number > 0, got -1"),
    ],
)
def test_bad_hook_arguments_fail_at_build_time(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        HOOKS.build(dict(type="NanGuardHook", **kwargs))


def test_hook_resolves_from_mmdet3d_scope(monkeypatch):
    from mmdet3d.registry import HOOKS as MMDET3D_HOOKS
    from mmengine.registry import DefaultScope

    # mmdet3d's registry first imports mmdet3d.engine.hooks, which needs mmcv's compiled ops (absent from
    # mmcv-lite); mark that import done so that the real lookup (child scope, then MMEngine's root) runs.
    monkeypatch.setattr(MMDET3D_HOOKS, "_imported", True)
    assert MMDET3D_HOOKS.parent is HOOKS
    assert "NanGuardHook" not in MMDET3D_HOOKS.module_dict
    with DefaultScope.overwrite_default_scope("mmdet3d"):
        hook = MMDET3D_HOOKS.build(dict(type="NanGuardHook", snapshot_interval=100))
        drill = MMDET3D_HOOKS.build(dict(type="FaultInjectionHook", faults=[dict(kind="loss", iters=[3])]))
    assert isinstance(hook, petr_stability.NanGuardHook) and hook.config.snapshot_interval == 100
    assert isinstance(drill, petr_stability.FaultInjectionHook)


@pytest.mark.parametrize("amp", ["dynamic", None])
def test_healthy_step_reads_no_tensor_value(tmp_path, amp):
    # On CUDA every read of a tensor's value waits for the device. MMEngine already read this step's grad_norm
    # and loss into its message hub; the guard must reuse those floats on a step with no check or snapshot.
    from petr_stability.testing.reads import watch_healthy_steps

    runner = build_runner(str(tmp_path), amp=amp, max_iters=24, model_kwargs=dict(num_layers=1, num_query=16),
                          guard=dict(snapshot_interval=4, confirm_steps=3, check_interval=1000))
    calls = watch_healthy_steps(guard_hook(runner), snapshot_interval=4)
    runner.train()
    assert runner.iter == 24 and len(calls) >= 2 * 10
    assert [read for call in calls for read in call] == []


def test_guard_log_lines_name_the_guard_not_a_logging_helper(tmp_path):
    # MMEngine's formatter prints "<file> - <function>" on warnings and errors: they must point at the guard.
    import logging

    from mmengine.logging import MMLogger

    seen = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: seen.append(record)
    runner = build_runner(str(tmp_path), amp="dynamic", max_iters=16, guard=GUARD, model_kwargs=SMALL,
                          faults=[dict(kind="weights", iters=[12], value="nan")])
    MMLogger.get_current_instance().addHandler(handler)
    try:
        runner.train()
    finally:
        MMLogger.get_current_instance().removeHandler(handler)
    mine = [r for r in seen if r.getMessage().startswith("NanGuard: divergence at iter 12")]
    assert mine and os.path.basename(mine[0].pathname) == "chain.py" and mine[0].funcName == "_log_recovery"
