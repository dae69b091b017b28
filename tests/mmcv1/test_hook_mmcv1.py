"""NanGuardHook on tiny real MMCV 1.x runners (CPU, fp16 autocast, the seed's PETR-shaped layer config)."""
import math
import os

import pytest
import torch
from harness import LRRecorder, build_runner, guard_hook, mean_loss, opt_hook, params_finite, run
from mmcv.runner import HOOKS, Hook, Priority
from mmcv.utils import build_from_cfg

from petr_stability import NanGuardGaveUp, read_incidents, safe_load
from petr_stability.core.tree import iter_tensors
from petr_stability.core.watch.health import all_finite

#: A dynamic scale that starts where PETR's static one sits (65536 overflows ~8 times on this model first).
DYN = dict(init_scale=512.0)
FAST = dict(snapshot_interval=2, confirm_steps=2, check_interval=2, patience=2, static_patience=3)


def ckpt_finite(path):
    return all_finite(iter_tensors(safe_load(path, extra_globals=())))


def transformer_dropouts(r):
    layer = r.model.net.pts_bbox_head.layers[0]
    return [m.p for m in layer.modules() if isinstance(m, torch.nn.Dropout)]


def divergences(work_dir):
    return [rec for rec in read_incidents(work_dir) if rec["event"] == "divergence"]


# ------------------------------------------------------------------ registry and arguments
def test_found_in_mmcv_hooks_and_built_from_cfg():
    hook = build_from_cfg(dict(type="NanGuardHook", max_norm=2.0), HOOKS)
    assert type(hook).__module__ == "petr_stability.adapters.mmcv1_runner.hook"
    assert hook.config.max_norm == 2.0
    assert not hasattr(type(hook), "priority")  # MMCV 1.x register_hook refuses it
    assert HOOKS.get("FaultInjectionHook") is not None


def test_registered_like_mmdet_runs_after_checkpoint_hook(tmp_path):
    r = build_runner(str(tmp_path), guard=dict())
    names = [type(h).__name__ for h in r.hooks]
    assert names.index("NanGuardHook") > names.index("CheckpointHook") > names.index("CPUFp16OptimizerHook")
    assert guard_hook(r).priority == Priority.NORMAL.value


@pytest.mark.parametrize("kwargs, bad", [
    (dict(snapshot_interval=0), "0"),
    (dict(max_norm=-1.0), "-1.0"),
    (dict(remedies=["clip", "pray"]), "'pray'"),
    (dict(check_interval="often"), "'often'"),
    (dict(keep_snapshots=1), "1"),
])
def test_bad_args_raise_naming_the_value(kwargs, bad):
    with pytest.raises((ValueError, TypeError), match=bad):
        build_from_cfg(dict(type="NanGuardHook", **kwargs), HOOKS)


# ------------------------------------------------------------------ end to end
def test_static_512_epoch_runner_recovers_from_poisoned_weights(tmp_path):
    wd = str(tmp_path)
    # NaN written twice: the first rolled back alone (issue 43: no step put it there), the second gets the known fix.
    r = build_runner(wd, runner="epoch", amp=512.0, max_epochs=2, guard=FAST,
                     faults=[dict(kind="weights", iters=[10, 12])], checkpoint=dict(interval=1))
    start = mean_loss(r)
    run(r)
    g = guard_hook(r).guard
    assert g.recoveries == 2 and r.epoch == 2
    assert params_finite(r) and mean_loss(r) < start
    assert opt_hook(r).grad_clip["max_norm"] == 1.0 and set(transformer_dropouts(r)) == {0.0}
    assert r.model.net.img_backbone.drop_path.drop_prob == 0.1  # backbone left alone
    assert opt_hook(r)._scale_update_param == 512.0  # a divergence does not change the scale mode
    for name in ("epoch_1.pth", "epoch_2.pth", "latest.pth"):
        assert ckpt_finite(os.path.join(wd, name)), name
    rec = divergences(wd)
    assert [r["iteration"] for r in rec] == [10, 12] and rec[0]["restored_from"]["source"] == "memory"
    assert rec[0]["cause"]["signals"].get("rollback_alone") is True and rec[0]["actions"] == []
    # the checkpoint carries the guard's state, as runner.meta['fp16'] carries the scaler's
    meta = safe_load(os.path.join(wd, "epoch_2.pth"), extra_globals=())["meta"]
    assert meta["nan_guard"]["recoveries"] == 2 and "loss_scaler" in meta["fp16"]


def test_dynamic_iter_runner_recovers_and_counts_max_iters(tmp_path):
    wd = str(tmp_path)
    # Rollback alone: this test is about the counters; what max_norm 1 costs in 10 iterations is the demo's measure.
    r = build_runner(wd, runner="iter", amp="dynamic", max_iters=20, guard=dict(FAST, remedies=["rollback"]),
                     faults=[dict(kind="weights", iters=[10])], checkpoint=dict(interval=5))
    executed = LRRecorder()
    r.register_hook(executed)
    start = mean_loss(r)
    run(r)
    g = guard_hook(r).guard
    assert g.recoveries == 1 and r.iter == 20
    assert len(executed.steps) == 20 + g.chain.iterations_lost  # counted steps stay max_iters; data moved on
    assert g.chain.iterations_lost == 2  # iteration 10 diverged; the unconfirmed snapshot of 8 is the newest state
    assert params_finite(r) and mean_loss(r) < start
    for name in ("iter_5.pth", "iter_10.pth", "iter_15.pth", "iter_20.pth", "latest.pth"):
        assert ckpt_finite(os.path.join(wd, name)), name


def test_fp32_optimizer_hook_recovers_and_skips_a_nan_gradient(tmp_path):
    wd = str(tmp_path)
    r = build_runner(wd, runner="epoch", amp=None, max_epochs=2, guard=FAST,
                     faults=[dict(kind="grads", iters=[4], value="nan"), dict(kind="weights", iters=[11])])
    start = mean_loss(r)
    run(r)
    g = guard_hook(r).guard
    assert g.skipped_steps >= 1  # the NaN gradient was dropped before AdamW applied it
    assert g.recoveries == 1 and params_finite(r) and mean_loss(r) < start
    assert divergences(wd)[0]["iteration"] == 11


def test_harmless_overflow_changes_nothing(tmp_path):
    wd = str(tmp_path)
    r = build_runner(wd, runner="iter", amp=dict(init_scale=512.0), max_iters=12, guard=FAST,
                     faults=[dict(kind="grads", iters=[6], value="inf")])
    dropouts = transformer_dropouts(r)
    run(r)
    g = guard_hook(r).guard
    assert g.skipped_steps == 1 and g.recoveries == 0 and g.stalls == 0
    assert opt_hook(r).grad_clip["max_norm"] == 35 and transformer_dropouts(r) == dropouts and 0.1 in dropouts
    assert opt_hook(r).loss_scaler.get_scale() < 512.0  # the scaler backed off by itself
    assert read_incidents(wd) == []


def test_static_scale_overflowing_every_step_becomes_dynamic(tmp_path):
    wd = str(tmp_path)
    r = build_runner(wd, runner="iter", amp=2.0 ** 40, max_iters=14, guard=FAST)
    run(r)
    g = guard_hook(r).guard
    hook = opt_hook(r)
    assert g.stalls == 1 and g.remedy("scale").scale_made_dynamic and hook._scale_update_param is None
    assert hook.loss_scaler.get_scale() < 2.0 ** 40
    stalled = [rec for rec in read_incidents(wd) if rec["event"] == "stalled"]
    assert len(stalled) == 1 and stalled[0]["actions"][0]["new"] == "dynamic"
    assert stalled[0]["iteration"] == FAST["static_patience"]
    assert g.recoveries == 0 and params_finite(r)


def test_lr_of_first_step_after_rollback_follows_restored_counter(tmp_path):
    lr_config = dict(policy="step", step=[8, 14], gamma=0.1, by_epoch=False, warmup="linear", warmup_iters=6,
                     warmup_ratio=0.1)
    r = build_runner(str(tmp_path), runner="iter", amp=DYN, max_iters=18, guard=FAST, lr_config=lr_config,
                     faults=[dict(kind="weights", iters=[10])])
    rec = LRRecorder()
    r.register_hook(rec)
    run(r)
    assert guard_hook(r).guard.recoveries == 1
    iters = [i for i, _ in rec.steps]
    back = next(k for k in range(1, len(iters)) if iters[k] <= iters[k - 1])
    restored_iter, lr_after = rec.steps[back]
    first_pass = dict(rec.steps[:back])
    assert restored_iter < 9 and lr_after == pytest.approx(first_pass[restored_iter])
    assert restored_iter >= 8 or lr_after != first_pass[9]  # it is not the LR of the failed iteration


def test_a_backed_off_rate_is_given_back_through_the_lr_updater_hook(tmp_path):
    # lr_rewarm on MMCV 1.x: the backoff and the re-warm both scale the LrUpdaterHook's bases, so the warm-up and the
    # steps the hook computes each iteration continue at the factor, then at the schedule's own rate again. The
    # replay is off and the ladder is the lr rung alone, so the first divergence backs the rate off.
    lr_config = dict(policy="step", step=[16], gamma=0.1, by_epoch=False, warmup="linear", warmup_iters=4,
                     warmup_ratio=0.1)
    guard = dict(FAST, diagnose=False, remedies=["rollback", "lr"], ladder=[["lr"]], lr_rewarm=3)
    plain = build_runner(str(tmp_path / "plain"), runner="iter", amp=DYN, max_iters=20, lr_config=dict(lr_config))
    schedule = LRRecorder()
    plain.register_hook(schedule)
    run(plain)
    want = dict(schedule.steps)
    r = build_runner(str(tmp_path / "guarded"), runner="iter", amp=DYN, max_iters=20, guard=guard,
                     lr_config=dict(lr_config), faults=[dict(kind="weights", iters=[8])])
    rec = LRRecorder()
    r.register_hook(rec)
    run(r)
    lr = guard_hook(r).guard.remedy("lr")
    assert guard_hook(r).guard.recoveries == 1 and len(lr.lr_rewarms) == 1 and lr.lr_factor == 1.0
    back = next(k for k in range(1, len(rec.steps)) if rec.steps[k][0] <= rec.steps[k - 1][0])
    given = lr.lr_rewarms[0]["iteration"]  # 1-based: the 0-based iterations from it on run at the schedule's rate
    factor = lr.config.lr_backoff  # the ladder's factor, whatever its default
    backed = [(it, got) for it, got in rec.steps[back:] if it < given]
    assert len(backed) == 3 and all(got == pytest.approx(factor * want[it]) for it, got in backed), backed
    again = [(it, got) for it, got in rec.steps[back:] if it >= given]
    assert again and all(got == pytest.approx(want[it]) for it, got in again), again
    assert any(it >= 16 for it, _ in again)  # past the step: the hook's own decay, from the base given back


def test_epoch_lr_survives_a_rollback_across_the_epoch_boundary(tmp_path):
    # CosineAnnealing by epoch (PETR's lr_config): LR is set once per epoch, so a snapshot's LR must not come back.
    lr_config = dict(policy="CosineAnnealing", min_lr_ratio=0.01, by_epoch=True)
    guard = dict(FAST, snapshot_interval=4, confirm_steps=3)
    r = build_runner(str(tmp_path), runner="epoch", amp=512.0, max_epochs=3, n_samples=8, guard=guard,
                     lr_config=lr_config, faults=[dict(kind="weights", iters=[6])])
    rec = LRRecorder()
    r.register_hook(rec)
    run(r)
    assert guard_hook(r).guard.recoveries == 1
    lr_epoch2 = rec.steps[4][1]
    after = [lr for (it, lr) in rec.steps[4:8]]
    assert lr_epoch2 != rec.steps[0][1] and after == [lr_epoch2] * 4
    assert divergences(str(tmp_path))[0]["restored_from"]["iteration"] < 4  # restored into epoch 1's state


@pytest.mark.parametrize("runner", ["epoch", "iter"])
def test_resume_keeps_remedies(tmp_path, runner):
    wd = str(tmp_path)
    kw = dict(runner=runner, amp=512.0, guard=FAST)
    # NaN written twice: the first rolled back alone (issue 43), the second gets the known manual fix. An epoch of 8
    # batches rolled back from 5 ends at iteration 5: the epoch runner's second NaN comes in its second epoch.
    faults = [dict(kind="weights", iters=[5, 7 if runner == "iter" else 9])]
    r = build_runner(wd, max_epochs=2, max_iters=8, faults=faults,
                     checkpoint=dict(interval=1 if runner == "epoch" else 8), **kw)
    run(r)
    assert guard_hook(r).guard.recoveries == 2
    r2 = build_runner(wd, max_epochs=3, max_iters=12, **kw)
    assert opt_hook(r2).grad_clip["max_norm"] == 35 and 0.1 in transformer_dropouts(r2)
    r2.resume(os.path.join(wd, "latest.pth"), map_location="cpu")
    run(r2)
    g = guard_hook(r2).guard
    assert g.recoveries == 2 and g.remedy("dropout").dropout_zeroed
    assert opt_hook(r2).grad_clip["max_norm"] == 1.0 and set(transformer_dropouts(r2)) == {0.0}


def test_iter_runner_resumed_from_another_directory_keeps_remedies(tmp_path):
    # IterBasedRunner.resume does not copy the file's meta into runner.meta, and the file is not in the new work dir:
    # the guard finds it through the run's config (mmdet's tools/train.py keeps cfg.pretty_text in runner.meta).
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    kw = dict(runner="iter", amp=512.0, guard=FAST)
    run(build_runner(first, max_iters=8, faults=[dict(kind="weights", iters=[5, 7])], checkpoint=dict(interval=8),
                     **kw))  # the first NaN rolled back alone (issue 43), the second with the known manual fix
    path = os.path.join(first, "iter_8.pth")
    r2 = build_runner(second, max_iters=12, **kw)
    r2.meta = dict(r2.meta or {}, config=f"resume_from = {path!r}\nwork_dir = {second!r}\n")
    r2.resume(path, map_location="cpu")
    run(r2)
    g = guard_hook(r2).guard
    assert g.recoveries == 2 and g.remedy("dropout").dropout_zeroed
    assert opt_hook(r2).grad_clip["max_norm"] == 1.0 and set(transformer_dropouts(r2)) == {0.0}


def test_endless_divergence_gives_up_cleanly(tmp_path):
    wd = str(tmp_path)
    r = build_runner(wd, runner="iter", amp=DYN, max_iters=60, guard=dict(FAST, max_recoveries=2),
                     faults=[dict(kind="weights", iters=list(range(5, 61)))], checkpoint=dict(interval=2))
    with pytest.raises(NanGuardGaveUp, match="max_recoveries=2"):
        run(r)
    assert r.iter < 30
    assert [rec["event"] for rec in read_incidents(wd)][-1] == "gave_up"
    latest = os.path.join(wd, "latest.pth")
    assert not os.path.exists(latest) or ckpt_finite(latest)
    last = r.meta["hook_msgs"].get("last_ckpt")
    assert last is None or ckpt_finite(last)


@pytest.mark.parametrize("last", [8, 16])  # the last iteration of epoch 1, and of the run
def test_fault_on_last_iteration_of_epoch_and_of_run_epoch_runner(tmp_path, last):
    wd = str(tmp_path)
    r = build_runner(wd, runner="epoch", amp=DYN, max_epochs=2, guard=FAST,
                     faults=[dict(kind="weights", iters=[last])], checkpoint=dict(interval=1))
    run(r)
    assert guard_hook(r).guard.recoveries == 1 and r.epoch == 2 and params_finite(r)
    for name in ("epoch_1.pth", "epoch_2.pth", "latest.pth"):
        assert ckpt_finite(os.path.join(wd, name)), name


def test_fault_on_last_iteration_of_iter_run_rewrites_its_checkpoint(tmp_path):
    wd = str(tmp_path)
    r = build_runner(wd, runner="iter", amp=DYN, max_iters=12, guard=FAST,
                     faults=[dict(kind="weights", iters=[12])], checkpoint=dict(interval=6))
    seen = []

    class LatestAfterGuard(Hook):  # runs right after NanGuardHook on the iteration that failed
        def after_train_iter(self, runner):
            if guard_hook(runner).guard.recoveries and not seen:
                seen.append((runner.meta["hook_msgs"]["last_ckpt"], ckpt_finite(os.path.join(wd, "latest.pth"))))

    r.register_hook(LatestAfterGuard(), priority="LOWEST")
    run(r)
    assert guard_hook(r).guard.recoveries == 1 and r.iter == 12 and params_finite(r)
    assert seen and seen[0][0].endswith("iter_12.pth") and seen[0][1]  # repaired before the run went on
    assert ckpt_finite(os.path.join(wd, "iter_12.pth")) and ckpt_finite(os.path.join(wd, "latest.pth"))
    assert os.path.realpath(r.meta["hook_msgs"]["last_ckpt"]) == os.path.realpath(os.path.join(wd, "latest.pth"))


def test_max_keep_ckpts_1_keeps_the_healthy_file_a_poisoned_save_would_delete(tmp_path):
    # The poisoned save of iteration 6 must not make MMCV delete iter_5.pth; the run recovers from memory and
    # every file left on disk is finite.
    wd = str(tmp_path)
    r = build_runner(wd, runner="iter", amp=DYN, max_iters=10, guard=dict(FAST, confirm_steps=1000),
                     faults=[dict(kind="weights", iters=[6])], checkpoint=dict(interval=1, max_keep_ckpts=1))
    run(r)
    g = guard_hook(r).guard
    assert g.recoveries == 1 and r.iter == 10 and params_finite(r)
    assert divergences(wd)[0]["restored_from"] == {"source": "memory", "iteration": 4}
    assert ckpt_finite(os.path.join(wd, "latest.pth"))
    assert all(ckpt_finite(os.path.join(wd, f)) for f in os.listdir(wd) if f.endswith(".pth"))


def test_nonfinite_buffer_saved_in_checkpoint_is_caught_at_the_save(tmp_path):
    # NaN BatchNorm statistics show in no gradient: the save itself must trigger the check.
    wd = str(tmp_path)
    guard = dict(FAST, check_interval=1000, snapshot_interval=4)
    r = build_runner(wd, runner="iter", amp=DYN, max_iters=10, guard=guard, checkpoint=dict(interval=6))

    class PoisonBN(Hook):
        def before_train_iter(self, runner):
            if runner.iter == 5 and not getattr(self, "done", False):
                self.done = True
                runner.model.net.img_backbone.norm.running_var.fill_(math.nan)

    r.register_hook(PoisonBN(), priority="VERY_LOW")
    run(r)
    assert guard_hook(r).guard.recoveries == 1 and params_finite(r)
    assert divergences(wd)[0]["iteration"] == 6  # at the save, not at the next routine check
    assert ckpt_finite(os.path.join(wd, "iter_6.pth")) and ckpt_finite(os.path.join(wd, "latest.pth"))


@pytest.mark.parametrize("amp", ["dynamic", None])
def test_healthy_step_reads_no_tensor_value(tmp_path, amp):
    # On CUDA every read of a tensor's value waits for the device. The runner already read this step's
    # grad_norm and loss for its log; the guard must reuse those floats on a step with no check or snapshot.
    from petr_stability.testing.reads import watch_healthy_steps

    r = build_runner(str(tmp_path), runner="iter", amp=amp, max_iters=24, n_samples=32,
                     guard=dict(snapshot_interval=4, confirm_steps=3, check_interval=1000))
    calls = watch_healthy_steps(guard_hook(r), snapshot_interval=4)
    run(r)
    assert r.iter == 24 and len(calls) >= 2 * 10
    assert [read for call in calls for read in call] == []
