"""Cause attribution on models and data shaped unlike the project's own, in a real MMEngine Runner (CPU).

The triggers are model or data behaviour: a forward that divides by a scale read as 0 from some iteration on (a code
bug: every batch breaks, a batch known to be good too), a plain ``torch.utils.data.Dataset`` (no ids, no infos) with
one sample holding NaN pixels served every epoch, a replay that cannot run.
"""
import uuid
from typing import Any, List, Optional

import pytest
import torch
from harness import guard_hook, params_finite
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.runner import Runner

import petr_stability  # noqa: F401  (registers the hooks)
from petr_stability import read_incidents
from petr_stability.adapters.mmengine_runner.io import MMEngineIO
from petr_stability.core.errors import StructuralDivergence
from petr_stability.testing.causes_models import (
    DropsSampleIds,
    IdentifiedDataset,
    build_memory_net,
    nan_loss_on_bad_boxes,
    plant_scale_bug,
    poison_box,
    poison_pixels,
)
from petr_stability.testing.data_faults import assert_burst_is_data
from petr_stability.testing.mmengine_cpu import PETRLikeModel, Regressor
from petr_stability.testing.petr_like import make_batch
from petr_stability.testing.plain import Pairs, squared_error

SMALL = dict(num_layers=1, num_query=16)
GUARD = dict(snapshot_interval=4, confirm_steps=2, check_interval=4)
N = 16
BUG_AFTER = 10  # the forward breaks from iteration 11 on
BAD = 9  # a sample served in the 5th iteration of every epoch (batch size 2, no shuffle)


class IdsModel(DropsSampleIds, PETRLikeModel):
    """PETRLikeModel taking the batch's ``sample_idx`` (its own forward rejects unknown keys)."""


class Plain(torch.utils.data.Dataset):
    """The PyTorch default: a map-style dataset of tensors, no ids, no infos; counts what it serves."""

    def __init__(self, n: int, bad: Optional[int] = None, kind: str = "pixels") -> None:
        self.samples = make_batch(n, num_query=16, seed=0)
        if bad is not None:
            self.samples[bad] = (poison_box if kind == "box" else poison_pixels)(self.samples[bad])
        self.served: List[int] = []

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        self.served.append(int(i))
        return self.samples[i]


class MixingRegressor(Regressor):
    """Mixes its 8 features first (``x @ ones / 8``, a matmul: fp16 under autocast): a sample whose features are
    each within fp16's range (6e4 < 65504) sums past it, so its fp16 forward is non-finite while every value it
    carries is in range (a bright frame, not a raw 16-bit one)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ones", torch.ones(8, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor, mode: str = "loss") -> dict:
        return {"loss": squared_error(self.net, (x @ self.ones) / 8, y)}


def build(work_dir: str, dataset: Any, amp: Any = None, max_epochs: Optional[int] = None,
          max_iters: Optional[int] = None, bug_after: Optional[int] = None, guard: Optional[dict] = None,
          model: Optional[BaseModel] = None, hooks: Optional[List[Hook]] = None, shuffle: bool = False) -> Runner:
    torch.manual_seed(0)
    model = model if model is not None else IdsModel(**SMALL)
    if bug_after is not None:
        plant_scale_bug(model.net, bug_after)
    by_epoch = max_epochs is not None
    wrapper = dict(type="OptimWrapper") if amp is None else dict(type="CPUAmpOptimWrapper", loss_scale=amp)
    wrapper.update(optimizer=dict(type="AdamW", lr=2e-4, weight_decay=0.01), clip_grad=dict(max_norm=35, norm_type=2))
    return Runner(
        model=model, work_dir=work_dir, experiment_name=f"t{uuid.uuid4().hex[:10]}",
        train_dataloader=dict(dataset=dataset, sampler=dict(type="DefaultSampler", shuffle=shuffle), batch_size=2,
                              num_workers=0, collate_fn=dict(type="default_collate")),
        optim_wrapper=wrapper,
        train_cfg=dict(by_epoch=True, max_epochs=max_epochs) if by_epoch else dict(by_epoch=False,
                                                                                  max_iters=max_iters),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=10 ** 6, by_epoch=by_epoch),
                           logger=dict(type="LoggerHook", interval=5)),
        log_processor=dict(by_epoch=by_epoch),
        default_scope="mmengine", randomness=dict(seed=0), log_level="WARNING",
        custom_hooks=[dict(type="NanGuardHook", **dict(GUARD, **(guard or {})))] + list(hooks or []))


def decisions(work_dir: str) -> List[dict]:
    return [r for r in read_incidents(work_dir) if r["event"] in ("divergence", "gave_up")]


@pytest.mark.parametrize("ids", [True, False], ids=["ids", "no-ids"])
@pytest.mark.parametrize("amp", [None, dict(init_scale=8.0)], ids=["fp32", "fp16"])
def test_a_code_bug_breaking_every_forward_stops_as_structural_at_once(tmp_path, ids, amp):
    wd = str(tmp_path)
    dataset = IdentifiedDataset(64, num_query=16) if ids else Plain(64)
    runner = build(wd, dataset, amp=amp, max_iters=40, bug_after=BUG_AFTER)
    with pytest.raises(StructuralDivergence, match="known to be good"):
        runner.train()
    records = decisions(wd)
    assert len(records) <= 2 and records[-1]["event"] == "gave_up"
    stop = records[-1]
    assert stop["iteration"] - (BUG_AFTER + 1) < 10
    assert stop["cause"]["cause"] == "structural" and "every batch breaks" in stop["cause"]["evidence"]
    good = stop["diagnosis"]["good_batch"]
    assert good["reproduced"] is True and good["batch"] == f"the batch of iter {BUG_AFTER}"
    # Nothing was quarantined: a bug is not bad data.
    assert not guard_hook(runner).guard.remedy("quarantine").skip_list


@pytest.mark.parametrize("ids", [True, False], ids=["ids", "no-ids"])
@pytest.mark.parametrize("amp", [None, dict(init_scale=8.0)], ids=["fp32", "fp16"])
def test_a_forward_broken_from_the_start_is_structural_at_its_first_incident(tmp_path, ids, amp):
    # No batch of the run ever trained, so there is no batch known to be good: that every batch so far broke is the
    # evidence. Classed data, the first incident would quarantine good samples.
    wd = str(tmp_path)
    dataset = IdentifiedDataset(64, num_query=16) if ids else Plain(64)
    runner = build(wd, dataset, amp=amp, max_iters=40, bug_after=0)
    with pytest.raises(StructuralDivergence, match="since the run's start"):
        runner.train()
    (stop,) = decisions(wd)
    assert stop["event"] == "gave_up" and stop["cause"]["cause"] == "structural"
    assert stop["diagnosis"]["untrained_batches"] == stop["iteration"]
    assert stop["cause"]["signals"]["evidence_cause"] == "structural"
    assert not guard_hook(runner).guard.remedy("quarantine").skip_list


def test_the_counterfactual_keeps_bad_data_data(tmp_path):
    # The same guard on a real bad sample: NaN pixels poison BatchNorm's statistics (a divergence at once); the
    # batch known to be good trains fine on the healthy weights, so it is data, and the NaN sample alone is named.
    wd = str(tmp_path)
    runner = build(wd, Plain(N, bad=BAD, kind="pixels"), amp=None, max_epochs=2)
    runner.train()
    (rec,) = decisions(wd)
    assert rec["cause"]["cause"] == "data" and "known to be good, trains fine" in rec["cause"]["evidence"]
    assert rec["diagnosis"]["good_batch"]["reproduced"] is False
    assert rec["cause"]["signals"]["quarantined"] == [{"index": BAD}]
    assert list(guard_hook(runner).guard.remedy("quarantine").skip_list) == [BAD] and params_finite(runner)


@pytest.mark.parametrize("amp", [None, "dynamic", 512.0], ids=["fp32-skip", "fp16-dynamic", "fp16-static"])
def test_a_plain_dataset_sample_breaking_every_epoch_is_named_by_index_and_quarantined_once(tmp_path, amp):
    wd = str(tmp_path)
    runner = build(wd, Pairs(N, bad=[BAD]), amp=amp, max_epochs=4, model=Regressor())
    runner.train()
    assert runner.epoch == 4 and params_finite(runner)
    records = read_incidents(wd)
    recurring = [r for r in records if r["event"] == "recurring_sample"]
    assert len(recurring) == 1 and recurring[0]["batch"] == [{"index": BAD}] and recurring[0]["quarantined"]
    assert list(guard_hook(runner).guard.remedy("quarantine").skip_list) == [BAD]
    served = runner.train_dataloader.dataset.served  # the runner's own copy of the dataset
    assert served.count(BAD) == 2 and served.count(0) == 4  # epochs 3 and 4 never served it again
    assert not decisions(wd)  # nothing else: no rollback, no hyperparameter change
    if amp is None:
        skips = [r for r in records if r["event"] == "skip"]
        assert [r["batch"] for r in skips] == [[{"index": BAD}]] * 2


@pytest.mark.parametrize("amp", ["dynamic", 512.0], ids=["fp16-dynamic", "fp16-static"])
def test_a_sample_whose_fp16_forward_breaks_is_no_ordinary_overflow(tmp_path, amp):
    # The scaler skips the step, but no loss scale makes a forward non-finite (the loss comes before the scaling):
    # the step is recorded with its samples, as an fp32 skip is, and the sample breaking steps in two epochs is
    # quarantined, although none of its own values is past fp16's range.
    wd = str(tmp_path)
    dataset = Pairs(N, bad=[])
    dataset.x[BAD] = 6e4
    runner = build(wd, dataset, amp=amp, max_epochs=4, model=MixingRegressor(), shuffle=True)
    runner.train()
    assert runner.epoch == 4 and params_finite(runner)
    records = read_incidents(wd)
    skips = [r for r in records if r["event"] == "skip"]
    assert len(skips) == 2 and all({"index": BAD} in r["batch"] and len(r["batch"]) == 2 for r in skips)
    recurring = [r for r in records if r["event"] == "recurring_sample"]
    assert len(recurring) == 1 and recurring[0]["batch"] == [{"index": BAD}] and recurring[0]["quarantined"]
    assert list(guard_hook(runner).guard.remedy("quarantine").skip_list) == [BAD]
    assert runner.train_dataloader.dataset.served.count(BAD) == 2
    assert not decisions(wd)


def test_a_failed_diagnosis_records_its_error_and_where(tmp_path, monkeypatch):
    def broken(self, batch):
        def forward():
            raise RuntimeError("the replay cannot run here")
        return forward

    monkeypatch.setattr(MMEngineIO, "rerun_forward", broken)
    wd = str(tmp_path)
    runner = build(wd, Plain(64), amp=None, max_iters=16, bug_after=6, guard=dict(max_recoveries=0))
    with pytest.raises(petr_stability.NanGuardGaveUp):
        runner.train()
    diagnosis = decisions(wd)[-1]["diagnosis"]
    assert diagnosis["error"] == "RuntimeError: the replay cannot run here"
    assert diagnosis["traceback"] and diagnosis["traceback"][-1].endswith("in forward")


class MemoryCopy(Hook):
    """The head's memory as a copy, after every iteration: before NanGuardHook (ABOVE_NORMAL) or after it (LOW)."""

    def __init__(self, priority: str) -> None:
        self.priority = priority
        self.copies: List[Optional[torch.Tensor]] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        memory = runner.model.net.pts_bbox_head.memory_embedding
        self.copies.append(None if memory is None else memory.detach().clone())


def test_a_no_rollback_data_incident_leaves_the_memory_as_the_failing_step_left_it(tmp_path):
    # A burst of degenerate boxes (NaN targets) in three batches in a row: three skipped fp32 steps, a divergence on
    # a finite state (no rollback). Its diagnosis replays the failing batch twice and the last good one once through
    # the StreamPETR-style head; none of that may stay in the memory the next frame reads.
    wd = str(tmp_path)
    dataset = IdentifiedDataset(N, num_query=16)
    for i in (8, 10, 12):
        dataset.samples[i] = poison_box(dataset.samples[i])
    before, after = MemoryCopy("ABOVE_NORMAL"), MemoryCopy("LOW")
    model = IdsModel(**SMALL)
    model.net = nan_loss_on_bad_boxes(build_memory_net(**SMALL))
    runner = build(wd, dataset, amp=None, max_epochs=1, model=model, hooks=[before, after],
                   guard=dict(quarantine_fraction=0.2))
    runner.train()
    (rec,) = decisions(wd)
    assert rec["iteration"] == 7 and rec["cause"]["cause"] == "data" and rec["restored_from"] is None
    assert rec["diagnosis"]["on_healthy_weights"]["reproduced"] and not rec["diagnosis"]["good_batch"]["reproduced"]
    assert torch.equal(before.copies[6], after.copies[6])  # exactly what the failing step left
    assert [i["index"] for i in rec["cause"]["signals"]["quarantined"]] == [12]



@pytest.mark.parametrize("amp", [None, dict(init_scale=8.0)], ids=["fp32", "fp16"])
def test_a_memory_the_live_weights_poisoned_never_makes_the_good_batch_look_bad(tmp_path, amp):
    # A StreamPETR-style head whose memory is a plain attribute, no nan_to_num on it: a NaN weight at iteration 30
    # makes the memory NaN. The replays on the healthy weights run with the memory of that moment (started afresh,
    # as a rollback to it does), not the live NaN one: the failing batch trains fine there, the class is dynamics,
    # the run recovers. With the live memory both the failing and the good batch broke: "every batch breaks, a bug".
    from petr_stability.adapters.mmengine_runner.faults import FaultInjectionHook

    wd = str(tmp_path)
    model = IdsModel(**SMALL)
    model.net = build_memory_net(**SMALL)
    head = "net.pts_bbox_head.query_embedding.weight"  # feeds the decoder, whose output the memory keeps
    fault = FaultInjectionHook([dict(kind="weights", iters=[30], value="nan", param=head)])
    runner = build(wd, Plain(N), amp=amp, max_iters=40, model=model, hooks=[fault])
    runner.train()
    assert runner.iter == 40 and params_finite(runner)
    records = decisions(wd)
    assert records and all(r["event"] == "divergence" for r in records)
    first = records[0]
    assert first["cause"]["cause"] != "structural", first["cause"]
    healthy = first["diagnosis"]["on_healthy_weights"]
    assert healthy["reproduced"] is False and healthy["state_setup"] == ["net.pts_bbox_head"]
    memory = runner.model.net.pts_bbox_head.memory_embedding
    assert memory is None or bool(torch.isfinite(memory).all())


@pytest.mark.parametrize("amp", [None, dict(init_scale=8.0)], ids=["fp32", "fp16"])
def test_a_burst_of_bad_batches_carrying_ids_is_data_batch_by_batch(tmp_path, amp):
    # Three consecutive batches each with one corrupt sample (NaN pixels), the samples carrying their sample_idx:
    # every one is data, named by index and id, quarantined; no timing rule turns the burst into "every batch breaks".
    wd = str(tmp_path)
    bad = [9, 11, 13]
    dataset = IdentifiedDataset(N, num_query=16, bad={i: "nan" for i in bad})
    runner = build(wd, dataset, amp=amp, max_epochs=3, guard=dict(quarantine_fraction=0.25))
    runner.train()
    assert runner.epoch == 3 and params_finite(runner)  # every epoch ran (rollbacks rewind the counter)
    quarantined = list(guard_hook(runner).guard.remedy("quarantine").skip_list)
    assert_burst_is_data(decisions(wd), quarantined, bad, dataset.samples)
