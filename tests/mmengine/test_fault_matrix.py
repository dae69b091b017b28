"""The fault matrix on a real MMEngine runner: each case finishes, or stops with the plugin's own error, and no
poisoned state is restored or left as the last checkpoint."""
import glob
import os
import signal
import subprocess
import sys

import torch
from harness import build_runner, guard_hook, params_finite
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from petr_stability import read_incidents
from petr_stability.adapters.mmengine_runner.checkpoints import load_mmengine_checkpoint as safe_load

SMALL = dict(num_layers=1, num_query=16)
GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)
AMP = dict(init_scale=64.0)  # no calibration overflows: snapshots come at predictable iterations
HERE = os.path.dirname(os.path.abspath(__file__))


def finite_file(path):
    ckpt = safe_load(path)
    return all(bool(torch.isfinite(v).all()) for v in ckpt["state_dict"].values() if v.is_floating_point())


def last_checkpoint(work_dir):
    with open(os.path.join(work_dir, "last_checkpoint")) as f:
        return f.read().strip()


@HOOKS.register_module(force=True)
class TruncateCheckpointHook(Hook):
    """Cuts a checkpoint file in half at a given iteration (a node died while writing it)."""

    priority = "LOWEST"

    def __init__(self, at_iter, name):
        self.at_iter, self.name = at_iter, name

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        if runner.iter + 1 == self.at_iter:
            path = os.path.join(runner.work_dir, self.name)
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.truncate(size // 2)


def test_fault_on_a_saving_iteration_with_max_keep_ckpts_1(tmp_path):
    wd = str(tmp_path)
    runner = build_runner(wd, amp="dynamic", max_iters=30, guard=GUARD, model_kwargs=SMALL,
                          checkpoint=dict(interval=10, max_keep_ckpts=1),
                          faults=[dict(kind="weights", iters=[20], value="nan")])
    runner.train()
    files = glob.glob(os.path.join(wd, "*.pth"))
    assert len(files) == 1 and all(finite_file(f) for f in files)
    assert os.path.basename(last_checkpoint(wd)) == os.path.basename(files[0])
    assert read_incidents(wd)[0]["iteration"] == 20 and params_finite(runner)


def test_nonfinite_buffer_no_gradient_shows_is_caught_at_the_save(tmp_path):
    # NaN BatchNorm statistics change no training gradient; the check before the save finds them.
    wd = str(tmp_path)
    runner = build_runner(wd, amp=AMP, max_iters=12, model_kwargs=SMALL,
                          guard=dict(GUARD, snapshot_interval=7, check_interval=1000),
                          checkpoint=dict(interval=10, max_keep_ckpts=1),
                          faults=[dict(kind="weights", iters=[10], value="nan",
                                       param="net.img_backbone.norm.running_var")])
    runner.train()
    (rec,) = read_incidents(wd)
    assert "while saving a checkpoint" in rec["reason"]
    (only,) = glob.glob(os.path.join(wd, "*.pth"))
    assert finite_file(only)
    assert bool(torch.isfinite(runner.model.net.img_backbone.norm.running_var).all())


def test_without_a_confirmed_snapshot_the_newest_unconfirmed_one_comes_before_any_checkpoint(tmp_path):
    wd = str(tmp_path)
    runner = build_runner(wd, amp=AMP, max_iters=16, model_kwargs=SMALL,
                          guard=dict(GUARD, confirm_steps=100),  # no snapshot is ever confirmed
                          checkpoint=dict(interval=5),
                          extra_hooks=[dict(type="TruncateCheckpointHook", at_iter=12, name="iter_10.pth")],
                          faults=[dict(kind="weights", iters=[13], value="nan")])
    runner.train()
    (rec,) = read_incidents(wd)
    # The restore order (docs/how-it-works.md): this run's unconfirmed snapshot of iteration 10, not a file.
    assert rec["restored_from"] == {"source": "memory", "iteration": 10} and rec["iterations_lost"] == 13 - 10
    assert params_finite(runner) and runner.iter == 16


def test_sigkill_after_a_recovery_then_resume_keeps_remedies_and_counters(tmp_path):
    wd = str(tmp_path)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "kill_worker.py"), wd], cwd=HERE, timeout=300,
                          capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert [r["event"] for r in read_incidents(wd)] == ["divergence", "divergence"]
    runner = build_runner(wd, amp="dynamic", max_iters=20, guard=GUARD, model_kwargs=SMALL, resume=True)
    runner.train()
    g = guard_hook(runner).guard
    assert g.recoveries == 2 and g.remedy("dropout").dropout_zeroed
    assert g.chain.iterations_lost == sum(r["iterations_lost"] for r in read_incidents(wd))
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 1.0
    head = runner.model.net.pts_bbox_head
    assert all(m.p == 0.0 for m in head.modules() if isinstance(m, torch.nn.Dropout))
    assert runner.iter == 20 and params_finite(runner)


def test_ema_weights_are_restored_with_the_model(tmp_path):
    # EMAHook runs before the guard here, so the poisoned weights reach the average first.
    runner = build_runner(str(tmp_path), amp="dynamic", max_iters=30, guard=GUARD, model_kwargs=SMALL,
                          hooks_before_guard=[dict(type="EMAHook", momentum=0.1)],
                          faults=[dict(kind="weights", iters=[22], value="nan")])
    runner.train()
    ema = next(h for h in runner.hooks if type(h).__name__ == "EMAHook").ema_model
    assert all(bool(torch.isfinite(p).all()) for p in ema.parameters())
    assert read_incidents(str(tmp_path))[0]["iteration"] == 22


def test_paramwise_lr_groups_come_back_with_the_rollback(tmp_path):
    pw = dict(custom_keys={"img_backbone": dict(lr_mult=0.1)})
    kw = dict(amp=dict(init_scale=64.0), max_iters=12, guard=GUARD, model_kwargs=SMALL, paramwise_cfg=pw)
    clean = build_runner(str(tmp_path / "clean"), **kw)
    clean.train()
    bad = build_runner(str(tmp_path / "bad"), faults=[dict(kind="weights", iters=[9], value="nan")], **kw)
    bad.train()
    lrs = lambda r: sorted({round(g["lr"], 12) for g in r.optim_wrapper.optimizer.param_groups})  # noqa: E731
    assert len(lrs(bad)) == 2 and lrs(bad) == lrs(clean)
    assert read_incidents(str(tmp_path / "bad"))[0]["restored_from"]["iteration"] == 5


def test_several_optimizers_optim_wrapper_dict(tmp_path):
    import uuid

    from mmengine.optim import OptimWrapper
    from mmengine.runner import Runner

    from petr_stability.testing.mmengine_cpu import ListDataset, PETRLikeModel
    from petr_stability.testing.petr_like import make_batch

    class TwoOptimizers(PETRLikeModel):
        def train_step(self, data, optim_wrapper):
            data = self.data_preprocessor(data, True)
            parsed, log_vars = self.parse_losses(self._run_forward(data, mode="loss"))
            parsed.backward()
            for w in optim_wrapper.values():  # each wrapper clips (through the guard's probe) and steps
                w.step()
                w.zero_grad()
            return log_vars

    model = TwoOptimizers(**SMALL)
    head = [p for n, p in model.named_parameters() if not n.startswith("net.img_backbone")]
    wrappers = dict(
        backbone=OptimWrapper(torch.optim.AdamW(model.net.img_backbone.parameters(), lr=2e-4),
                              clip_grad=dict(max_norm=35, norm_type=2)),
        head=OptimWrapper(torch.optim.AdamW(head, lr=2e-4)),  # no clip: the guard installs an observing one
    )
    runner = Runner(
        model=model, work_dir=str(tmp_path), experiment_name=f"t{uuid.uuid4().hex[:10]}",
        train_dataloader=dict(dataset=ListDataset(make_batch(64, num_query=16)),
                              sampler=dict(type="DefaultSampler", shuffle=False), batch_size=2, num_workers=0,
                              collate_fn=dict(type="default_collate")),
        optim_wrapper=wrappers, train_cfg=dict(by_epoch=False, max_iters=20),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=10 ** 6, by_epoch=False)),
        custom_hooks=[dict(type="FaultInjectionHook", faults=[dict(kind="weights", iters=[12, 14], value="nan")]),
                      dict(type="NanGuardHook", **GUARD)],
        default_scope="mmengine", randomness=dict(seed=0))
    runner.train()
    assert params_finite(runner) and runner.iter == 20
    _, rec = read_incidents(str(tmp_path))  # the first NaN is rolled back alone (issue 43); the second climbs
    targets = {a["target"]: (a["old"], a["new"]) for a in rec["actions"]}
    assert targets["optim_wrapper.backbone.clip_grad.max_norm"] == (35.0, 1.0)
    assert targets["optim_wrapper.head.clip_grad.max_norm"] == ("inf", 1.0)
    assert all(w.clip_grad_kwargs["max_norm"] == 1.0 for w in runner.optim_wrapper.values())
