"""Gradient accumulation (``accumulative_counts``) and rollbacks in a real MMEngine Runner (issue 33, CPU).

The triggers are data: samples holding NaN or Inf pixels (a corrupt image), three batches in a row across a window's
boundary, caught as each is served (a health check every iteration); and a run resumed inside a window. Each run
reads the gradients and the optim wrapper's accumulation counter before every iteration and counts what each sample
was served: a rollback leaves no partial window behind, the windows keep their boundaries, and only the bad samples
are named.
"""
import uuid
from typing import Any, List, Optional

import pytest
import torch
from harness import build_runner, guard_hook, params_finite
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.runner import Runner
from torch import nn

import petr_stability  # noqa: F401  (registers the hooks)
import petr_stability.testing.mmengine_cpu  # noqa: F401  (registers CPUAmpOptimWrapper, PETRLikeModel)
from petr_stability import read_incidents
from petr_stability.testing.causes_models import DropsSampleIds, IdentifiedDataset, poison_pixels
from petr_stability.testing.data_faults import (
    GradReads,
    assert_burst_is_data,
    assert_windows_line_up,
    named_indices,
    watch_steps,
)
from petr_stability.testing.mmengine_cpu import PETRLikeModel, Regressor
from petr_stability.testing.plain import Pairs
from petr_stability.testing.wrappers import Counted

SMALL = dict(num_layers=1, num_query=16)
EVERY = 4  # accumulative_counts
LR = 2e-4
#: Caught as served: a health check every iteration, inside windows too; snapshots every window.
GUARD = dict(snapshot_interval=4, confirm_steps=2, check_interval=1, quarantine_fraction=0.25)
#: Three batches in a row (batch size 2, no shuffle) each with one corrupt sample: iterations 6 and 7 inside the
#: window 5-8, and 8, its stepping iteration.
BURST = {11: "nan", 13: "inf", 15: "nan"}


class IdsModel(DropsSampleIds, PETRLikeModel):
    """PETRLikeModel taking the batch's ``sample_idx``."""


class Reads(Hook):
    """Before each iteration: the gradients (:class:`GradReads`) and (iteration counter, the optim wrapper's count)."""

    priority = "HIGHEST"

    def __init__(self) -> None:
        self.grads = GradReads()
        self.counts: List[tuple] = []

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self.grads.read(runner.iter + 1, runner.model)
        self.counts.append((runner.iter, runner.optim_wrapper._inner_count))


def build(work_dir: str, dataset: Any, amp: Any, model: Optional[BaseModel] = None, epochs: int = 3) -> Runner:
    torch.manual_seed(0)
    wrapper = dict(type="OptimWrapper") if amp is None else dict(type="CPUAmpOptimWrapper", loss_scale=amp)
    wrapper.update(optimizer=dict(type="AdamW", lr=LR, weight_decay=0.01), clip_grad=dict(max_norm=35, norm_type=2),
                   accumulative_counts=EVERY)
    return Runner(
        model=model if model is not None else IdsModel(**SMALL), work_dir=work_dir,
        experiment_name=f"t{uuid.uuid4().hex[:10]}",
        train_dataloader=dict(dataset=dataset, sampler=dict(type="DefaultSampler", shuffle=False), batch_size=2,
                              num_workers=0, collate_fn=dict(type="default_collate")),
        optim_wrapper=wrapper, train_cfg=dict(by_epoch=True, max_epochs=epochs),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=10 ** 6, by_epoch=True),
                           logger=dict(type="LoggerHook", interval=5)),
        log_processor=dict(by_epoch=True), default_scope="mmengine", randomness=dict(seed=0), log_level="WARNING",
        custom_hooks=[dict(type="NanGuardHook", **GUARD), Reads()])


def reads_of(runner: Runner) -> Reads:
    return next(h for h in runner.hooks if isinstance(h, Reads))


def dropouts(runner: Runner) -> List[float]:
    return [m.p for m in runner.model.net.pts_bbox_head.modules() if isinstance(m, nn.Dropout)]


@pytest.mark.parametrize("amp", [None, dict(init_scale=8.0)], ids=["fp32", "fp16"])
def test_a_burst_across_a_window_boundary_leaves_no_partial_window_behind(tmp_path, amp, monkeypatch):
    # Before the fix every window after a rollback started with 22 of 27 gradient tensors NaN (the abandoned window's
    # bad batch), so its step was thrown away: an fp32 skip record naming two good samples, or an fp16 overflow.
    wd = str(tmp_path)
    steps = watch_steps(monkeypatch)
    dataset = IdentifiedDataset(16, num_query=16, bad=BURST)
    runner = build(wd, dataset, amp)
    before = dropouts(runner)
    runner.train()
    assert runner.epoch == 3 and params_finite(runner)
    reads = reads_of(runner)
    assert assert_windows_line_up(reads.grads, steps, EVERY) == 3  # three rollbacks, no window carried over
    assert all(it == count for it, count in reads.counts), reads.counts  # the count follows the restored counter
    records = read_incidents(wd)
    assert set(named_indices(records)) == set(BURST), records  # the bad samples alone, in every record
    quarantined = list(guard_hook(runner).guard.remedy("quarantine").skip_list)
    assert_burst_is_data(records, quarantined, list(BURST), dataset.samples)
    served = runner.train_dataloader.dataset.served  # the runner's own copy of the dataset
    assert all(served[i] == 1 for i in BURST), served  # quarantined where first served
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 35
    assert runner.optim_wrapper.param_groups[0]["lr"] == LR and dropouts(runner) == before


def test_a_rollback_to_a_start_inside_a_window_restarts_it_from_zero_gradients(tmp_path, monkeypatch):
    # Resumed from iter_6.pth, inside the window 5-8 (the file holds no gradients, and MMEngine's resume starts the
    # window's rest from zero ones). A corrupt sample served at iteration 7 breaks the run before any snapshot: the
    # restore point is that start, and the state "at iteration 6" is the resumed one: zero gradients, count 6, the
    # window still stepping at 8. Before the fix iteration 7 started again with the NaN gradients of the abandoned one.
    wd = str(tmp_path)
    build_runner(wd, amp=None, max_iters=6, guard=None, model_kwargs=SMALL, accumulative_counts=EVERY,
                 checkpoint=dict(interval=6)).train()
    steps = watch_steps(monkeypatch)
    runner = build_runner(wd, amp=None, max_iters=16, guard=GUARD, model_kwargs=SMALL, accumulative_counts=EVERY,
                          resume=True)
    reads = Reads()
    runner.register_hook(reads, priority="HIGHEST")
    samples = runner._train_dataloader["dataset"].samples
    samples[13] = poison_pixels(samples[13])  # served at iteration 7 (batch size 2, no shuffle)
    runner._train_dataloader["dataset"] = Counted(runner._train_dataloader["dataset"])
    runner.train()
    assert runner.iter == 16 and params_finite(runner)
    ((rec,),) = [[r for r in read_incidents(wd) if r["event"] == "divergence"]]
    assert rec["iteration"] == 7 and rec["restored_from"] == {"source": "start", "iteration": 6}
    assert assert_windows_line_up(reads.grads, steps, EVERY) == 1
    after = reads.grads.after_rollbacks()
    assert [row[0] for row in after] == [7] and after[0][1:] == (0, 0, 0)  # no gradient held at all
    assert all(it == count for it, count in reads.counts), reads.counts
    assert named_indices(read_incidents(wd)) == [13] and runner.train_dataloader.dataset.fetches[13] == 1


def test_a_bad_sample_inside_a_window_is_the_one_named(tmp_path):
    # Sample 9 (NaN features) is served at iteration 5 of every epoch, inside the window 5-8; nothing it touches is
    # state, so the window's step at iteration 8 is where its NaN gradient shows. The guard names the batch in hand
    # there (samples 14 and 15, good) in a skip record each epoch, and quarantines them as recurring; sample 9 is never
    # named and keeps being served (core/batches.py, BatchWatch.suspects / blame; watch/skips.py).
    wd = str(tmp_path)
    runner = build(wd, Pairs(16, bad=[9]), None, model=Regressor(), epochs=3)
    runner.train()
    assert set(named_indices(read_incidents(wd))) == {9}
    assert list(guard_hook(runner).guard.remedy("quarantine").skip_list) == [9]
