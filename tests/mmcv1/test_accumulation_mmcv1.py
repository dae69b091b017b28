"""Gradient accumulation (``GradientCumulativeOptimizerHook`` and its fp16 variant) and rollbacks on a real MMCV 1.x
``EpochBasedRunner`` (issue 33, CPU).

The triggers are data: samples holding NaN or Inf pixels (a corrupt image), three batches in a row across a window's
boundary, caught as each is served (a health check every iteration). Each run reads the gradients before every
iteration and counts what each sample was served: a rollback leaves no partial window behind, the windows keep their
boundaries (MMCV's hooks place them by ``runner.iter``, which the rollback rewinds), and only the bad samples are
named.
"""
import logging
import uuid
from typing import Any, Dict, List

import pytest
import torch
from harness import guard_hook, opt_hook, params_finite, run
from mmcv.runner import EpochBasedRunner, GradientCumulativeOptimizerHook, Hook, build_optimizer
from torch import nn
from torch.utils.data import DataLoader

import petr_stability  # noqa: F401  (registers the hooks)
from petr_stability import read_incidents
from petr_stability.testing.causes_models import DropsSampleIds, IdentifiedDataset
from petr_stability.testing.data_faults import (
    GradReads,
    assert_burst_is_data,
    assert_windows_line_up,
    named_indices,
    watch_steps,
)
from petr_stability.testing.mmcv1_cpu import CPUGradientCumulativeFp16OptimizerHook, PETRLikeMMCV1
from petr_stability.testing.petr_like import SEED_LAYER_CFG
from petr_stability.testing.plain import Pairs, mlp, squared_error

MODEL = dict(num_layers=1, num_query=16, layer_cfg=SEED_LAYER_CFG)
EVERY = 4  # cumulative_iters
LR = 2e-4
#: Caught as served: a health check every iteration, inside windows too; snapshots every window.
GUARD = dict(snapshot_interval=4, confirm_steps=2, check_interval=1, quarantine_fraction=0.25)
#: Three batches in a row (batch size 2, no shuffle) each with one corrupt sample: iterations 6 and 7 inside the
#: window 5-8, and 8, its stepping iteration.
BURST = {11: "nan", 13: "inf", 15: "nan"}


class IdsModel(DropsSampleIds, PETRLikeMMCV1):
    """PETRLikeMMCV1 taking the batch's ``sample_idx``."""


class ReadGrads(Hook):
    """The gradients before each iteration."""

    def __init__(self) -> None:
        self.reads = GradReads()

    def before_train_iter(self, runner: Any) -> None:
        self.reads.read(runner.iter + 1, runner.model)


def build(work_dir: str, dataset: Any, amp: Any, model: nn.Module, epochs: int = 3) -> Any:
    torch.manual_seed(0)
    optimizer = build_optimizer(model, dict(type="AdamW", lr=LR, weight_decay=0.01))
    logger = logging.getLogger(f"mmcv1-accumulation-{uuid.uuid4().hex[:8]}")
    logger.setLevel(logging.INFO)
    r = EpochBasedRunner(model=model, optimizer=optimizer, work_dir=work_dir, logger=logger, meta={},
                         max_epochs=epochs)
    clip = dict(max_norm=35, norm_type=2)
    optimizer_config = (dict(type="GradientCumulativeOptimizerHook", grad_clip=clip, cumulative_iters=EVERY)
                        if amp is None else dict(type="CPUGradientCumulativeFp16OptimizerHook", loss_scale=amp,
                                                 grad_clip=clip, cumulative_iters=EVERY))
    r.register_training_hooks(dict(policy="fixed"), optimizer_config, dict(interval=10 ** 6, by_epoch=True),
                              dict(interval=5, hooks=[dict(type="TextLoggerHook")]),
                              custom_hooks_config=[dict(type="NanGuardHook", **GUARD)])
    r.register_hook(ReadGrads(), priority="HIGHEST")
    r.loader = DataLoader(dataset, batch_size=2, shuffle=False)
    return r


def reads_of(r: Any) -> GradReads:
    return next(h for h in r.hooks if isinstance(h, ReadGrads)).reads


def dropouts(r: Any) -> List[float]:
    return [m.p for m in r.model.net.pts_bbox_head.modules() if isinstance(m, nn.Dropout)]


@pytest.mark.parametrize("amp", [None, dict(init_scale=8.0)], ids=["fp32", "fp16"])
def test_a_burst_across_a_window_boundary_leaves_no_partial_window_behind(tmp_path, amp, monkeypatch):
    # The restore zeroes the abandoned window's gradients (without it, 22 of 27 gradient tensors enter the next window
    # NaN); MMCV's hooks derive the window from runner.iter and their other counters from max_iters, so the rewound
    # counter puts every window where an uninterrupted run has it.
    wd = str(tmp_path)
    steps = watch_steps(monkeypatch)
    dataset = IdentifiedDataset(16, num_query=16, bad=BURST)
    r = build(wd, dataset, amp, IdsModel(**MODEL))
    hook = opt_hook(r)
    assert isinstance(hook, GradientCumulativeOptimizerHook) and (amp is None) != isinstance(
        hook, CPUGradientCumulativeFp16OptimizerHook)
    before = dropouts(r)
    run(r)
    assert r.epoch == 3 and params_finite(r)
    assert assert_windows_line_up(reads_of(r), steps, EVERY) == 3  # three rollbacks, no window carried over
    records = read_incidents(wd)
    assert set(named_indices(records)) == set(BURST), records  # the bad samples alone, in every record
    quarantined = list(guard_hook(r).guard.remedy("quarantine").skip_list)
    assert_burst_is_data(records, quarantined, list(BURST), dataset.samples)
    assert all(dataset.served[i] == 1 for i in BURST), dataset.served  # quarantined where first served
    assert hook.grad_clip["max_norm"] == 35
    assert r.optimizer.param_groups[0]["lr"] == LR and dropouts(r) == before


class ListBatchModel(nn.Module):
    """An MLP with no BatchNorm and no ``nan_to_num``, whose ``train_step`` unpacks the collated ``[x, y]``: a NaN
    feature makes only the loss and the gradients NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def train_step(self, data: List[torch.Tensor], optimizer: Any = None, **kwargs: Any) -> Dict[str, Any]:
        x, y = data
        loss = squared_error(self.net, x, y)
        return dict(loss=loss, log_vars={"loss": float(loss)}, num_samples=int(x.shape[0]))


def test_a_bad_sample_inside_a_window_is_the_one_named(tmp_path):
    # Sample 9 (NaN features) is served at iteration 5 of every epoch, inside the window 5-8; nothing it touches is
    # state, so the window's step at iteration 8 is where its NaN gradient shows. The guard names the batch in hand
    # there (samples 14 and 15, good) each epoch and quarantines them as recurring; sample 9 is never named and keeps
    # being served (core/batches.py, BatchWatch.suspects / blame; watch/skips.py).
    wd = str(tmp_path)
    r = build(wd, Pairs(16, bad=[9]), None, ListBatchModel())
    run(r)
    assert set(named_indices(read_incidents(wd))) == {9}
    assert list(guard_hook(r).guard.remedy("quarantine").skip_list) == [9]
