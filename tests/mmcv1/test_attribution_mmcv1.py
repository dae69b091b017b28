"""Cause attribution on models and data shaped unlike the project's own, on real MMCV 1.x runners (CPU).

The triggers are model or data behaviour: a forward that divides by a scale read as 0 from some iteration on (a
code bug), a plain ``torch.utils.data.Dataset`` of ``(x, y)`` tuples with one sample holding NaN features every
epoch, a model whose ``train_step`` unpacks a list batch, a replay that cannot run.
"""
import logging
import uuid
from typing import Any, Dict, List, Optional

import pytest
import torch
from harness import guard_hook, params_finite, run
from mmcv.runner import EpochBasedRunner, IterBasedRunner, build_optimizer
from torch import nn
from torch.utils.data import DataLoader

import petr_stability  # noqa: F401  (registers the hooks)
from petr_stability import read_incidents
from petr_stability.adapters.mmcv1_runner.io import MMCV1IO
from petr_stability.core.errors import NanGuardGaveUp, StructuralDivergence
from petr_stability.testing.causes_models import DropsSampleIds, IdentifiedDataset, plant_scale_bug
from petr_stability.testing.data_faults import assert_burst_is_data
from petr_stability.testing.mmcv1_cpu import PETRLikeMMCV1
from petr_stability.testing.petr_like import SEED_LAYER_CFG
from petr_stability.testing.plain import Pairs, mlp, squared_error

MODEL = dict(num_layers=1, num_query=16, layer_cfg=SEED_LAYER_CFG)
GUARD = dict(snapshot_interval=4, confirm_steps=2, check_interval=4)
N = 16
BAD = 9  # served in the 5th iteration of every epoch (batch size 2, no shuffle)
BUG_AFTER = 10


class IdsModel(DropsSampleIds, PETRLikeMMCV1):
    """PETRLikeMMCV1 taking the batch's ``sample_idx``."""


class PlainPETR(torch.utils.data.Dataset):
    """The PETR-shaped samples without their ids: a plain map-style dataset."""

    def __init__(self, n: int) -> None:
        self.inner = IdentifiedDataset(n, num_query=16)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        sample = dict(self.inner[i])
        sample.pop("sample_idx")
        return sample


class TokensInInfos(PlainPETR):
    """StreamPETR's shape: the batch's ``img_metas`` carry no sample id, the dataset's ``data_infos`` hold each
    sample's nuScenes ``token``; one sample holds NaN camera features."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.inner = IdentifiedDataset(n, num_query=16, bad={bad: "nan"})
        self.data_infos = [{"token": f"nusc{i:04d}", "scene_token": f"scene{i // 4}"} for i in range(n)]


class ListBatchModel(nn.Module):
    """A model unlike mmdet's: ``train_step`` takes the collated list ``[x, y]`` and unpacks it itself (no
    ``model(**batch)`` possible); no BatchNorm, no ``nan_to_num``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return squared_error(self.net, x, y)

    def train_step(self, data: List[torch.Tensor], optimizer: Any = None, **kwargs: Any) -> Dict[str, Any]:
        x, y = data
        loss = self(x, y)
        return dict(loss=loss, log_vars={"loss": float(loss)}, num_samples=int(x.shape[0]))


def build(work_dir: str, dataset: Any, model: Optional[nn.Module] = None, amp: Any = None, epochs: int = 3,
          iters: Optional[int] = None, guard: Optional[dict] = None, bug_after: Optional[int] = None,
          hooks: Optional[List[dict]] = None) -> Any:
    torch.manual_seed(0)
    model = model if model is not None else IdsModel(**MODEL)
    if bug_after is not None:
        plant_scale_bug(model.net, bug_after)
    optimizer = build_optimizer(model, dict(type="AdamW", lr=2e-4, weight_decay=0.01))
    logger = logging.getLogger(f"mmcv1-attribution-{uuid.uuid4().hex[:8]}")
    logger.setLevel(logging.INFO)
    cls, length = (EpochBasedRunner, dict(max_epochs=epochs)) if iters is None else (IterBasedRunner,
                                                                                     dict(max_iters=iters))
    r = cls(model=model, optimizer=optimizer, work_dir=work_dir, logger=logger, meta={}, **length)
    clip = dict(max_norm=35, norm_type=2)
    optimizer_config = (dict(type="OptimizerHook", grad_clip=clip) if amp is None else
                        dict(type="CPUFp16OptimizerHook", loss_scale=amp, grad_clip=clip))
    r.register_training_hooks(dict(policy="fixed"), optimizer_config, dict(interval=10 ** 6, by_epoch=iters is None),
                              dict(interval=5, hooks=[dict(type="TextLoggerHook")]),
                              custom_hooks_config=list(hooks or [])
                              + [dict(type="NanGuardHook", **dict(GUARD, **(guard or {})))])
    r.loader = DataLoader(dataset, batch_size=2, shuffle=False)
    return r


def decisions(work_dir: str) -> List[dict]:
    return [r for r in read_incidents(work_dir) if r["event"] in ("divergence", "gave_up")]


@pytest.mark.parametrize("ids", [True, False], ids=["ids", "no-ids"])
@pytest.mark.parametrize("runner", ["epoch", "iter"])
def test_a_code_bug_breaking_every_forward_stops_as_structural_at_once(tmp_path, ids, runner):
    wd = str(tmp_path)
    dataset = IdentifiedDataset(64, num_query=16) if ids else PlainPETR(64)
    r = build(wd, dataset, epochs=2, iters=40 if runner == "iter" else None, bug_after=BUG_AFTER)
    with pytest.raises(StructuralDivergence, match="known to be good"):
        run(r)
    records = decisions(wd)
    assert len(records) <= 2 and records[-1]["event"] == "gave_up"
    stop = records[-1]
    assert stop["iteration"] - (BUG_AFTER + 1) < 10
    assert stop["cause"]["cause"] == "structural" and stop["diagnosis"]["good_batch"]["reproduced"] is True
    assert not guard_hook(r).guard.remedy("quarantine").skip_list


@pytest.mark.parametrize("amp", [None, "dynamic"], ids=["fp32", "fp16-dynamic"])
def test_a_forward_broken_from_the_start_is_structural_at_its_first_incident(tmp_path, amp):
    wd = str(tmp_path)
    r = build(wd, IdentifiedDataset(64, num_query=16), amp=amp, iters=40, bug_after=0)
    with pytest.raises(StructuralDivergence, match="since the run's start"):
        run(r)
    (stop,) = decisions(wd)
    assert stop["event"] == "gave_up" and stop["cause"]["cause"] == "structural"
    assert stop["diagnosis"]["untrained_batches"] == stop["iteration"]
    assert not guard_hook(r).guard.remedy("quarantine").skip_list


@pytest.mark.parametrize("amp", [None, "dynamic", 512.0], ids=["fp32-skip", "fp16-dynamic", "fp16-static"])
@pytest.mark.parametrize("runner", ["epoch", "iter"])
def test_a_plain_dataset_sample_breaking_every_epoch_is_named_by_index_and_quarantined_once(tmp_path, amp, runner):
    wd = str(tmp_path)
    dataset = Pairs(N, bad=[BAD])
    r = build(wd, dataset, model=ListBatchModel(), amp=amp, epochs=4, iters=32 if runner == "iter" else None)
    run(r)
    assert params_finite(r)
    records = read_incidents(wd)
    recurring = [rec for rec in records if rec["event"] == "recurring_sample"]
    assert len(recurring) == 1 and recurring[0]["batch"] == [{"index": BAD}] and recurring[0]["quarantined"]
    assert list(guard_hook(r).guard.remedy("quarantine").skip_list) == [BAD]
    # IterBasedRunner drew its first batch before any hook: from then on every batch is named by index.
    assert dataset.served.count(BAD) == 2 and dataset.served.count(0) == 4
    assert not decisions(wd)


@pytest.mark.parametrize("amp", [None, "dynamic"], ids=["fp32-skip", "fp16-dynamic"])
def test_a_sample_the_batch_names_by_nothing_is_named_by_its_infos_token(tmp_path, amp):
    wd = str(tmp_path)
    r = build(wd, TokensInInfos(N, BAD), model=PETRLikeMMCV1(**MODEL), amp=amp, epochs=3)
    run(r)
    assert params_finite(r)
    records = read_incidents(wd)
    named = [rec.get("batch") or ((rec.get("cause") or {}).get("signals") or {}).get("quarantined") for rec in records]
    assert records and named == [[{"index": BAD, "token": f"nusc{BAD:04d}"}]] * len(records), records
    assert list(guard_hook(r).guard.remedy("quarantine").skip_list) == [BAD]


def test_a_list_batch_train_step_is_replayed_the_way_the_runner_calls_it(tmp_path):
    # Three corrupt samples in a row (a burst): three skipped fp32 steps are a divergence, which is replayed
    # through the model's own train_step (model(**batch) would fail on a list) and classified.
    wd = str(tmp_path)
    dataset = Pairs(32, bad=[10, 12, 14])
    r = build(wd, dataset, model=ListBatchModel(), epochs=1)
    run(r)
    (rec,) = decisions(wd)
    assert "error" not in rec["diagnosis"], rec["diagnosis"]
    assert rec["diagnosis"]["reproduced"] is True and rec["cause"]["cause"] == "data"
    assert rec["cause"]["signals"]["quarantined"] == [{"index": 14}]  # the failing batch's bad sample, alone
    assert params_finite(r)


def test_a_failed_diagnosis_records_its_error_and_where(tmp_path, monkeypatch):
    def broken(self, batch):
        def forward():
            raise RuntimeError("the replay cannot run here")
        return forward

    monkeypatch.setattr(MMCV1IO, "rerun_forward", broken)
    wd = str(tmp_path)
    r = build(wd, PlainPETR(64), epochs=1, bug_after=6, guard=dict(max_recoveries=0))
    with pytest.raises(NanGuardGaveUp):
        run(r)
    diagnosis = decisions(wd)[-1]["diagnosis"]
    assert diagnosis["error"] == "RuntimeError: the replay cannot run here"
    assert diagnosis["traceback"] and diagnosis["traceback"][-1].endswith("in forward")


@pytest.mark.parametrize("amp", [None, dict(init_scale=8.0)], ids=["fp32", "fp16"])
def test_a_burst_of_bad_batches_carrying_ids_is_data_batch_by_batch(tmp_path, amp):
    # Three consecutive batches each with one corrupt sample (NaN pixels) carrying its sample_idx: each is data,
    # quarantined by index and id; no timing rule makes the burst "every batch breaks".
    wd = str(tmp_path)
    bad = [9, 11, 13]
    dataset = IdentifiedDataset(N, num_query=16, bad={i: "nan" for i in bad})
    r = build(wd, dataset, amp=amp, epochs=3, guard=dict(quarantine_fraction=0.25))
    run(r)
    assert r.epoch == 3 and params_finite(r)  # every epoch ran (rollbacks rewind the counter)
    assert_burst_is_data(decisions(wd), list(guard_hook(r).guard.remedy("quarantine").skip_list), bad, dataset.samples)


def test_a_memory_the_live_weights_poisoned_never_makes_the_good_batch_look_bad(tmp_path):
    # A StreamPETR-style head whose memory is a plain attribute (no nan_to_num on it): a NaN weight at iteration 30
    # makes it NaN. The replays on the healthy weights run with the memory of that moment (started afresh, as a
    # rollback to it does): the failing batch trains fine there, the run recovers instead of stopping as a bug.
    from petr_stability.testing.causes_models import build_memory_net

    wd = str(tmp_path)
    model = IdsModel(**MODEL)
    model.net = build_memory_net(num_layers=1, num_query=16, layer_cfg=SEED_LAYER_CFG)
    head = "net.pts_bbox_head.query_embedding.weight"  # feeds the decoder, whose output the memory keeps
    fault = dict(type="FaultInjectionHook", faults=[dict(kind="weights", iters=[30], value="nan", param=head)])
    r = build(wd, PlainPETR(N), model=model, iters=40, hooks=[fault])
    run(r)
    assert r.iter == 40 and params_finite(r)
    records = decisions(wd)
    assert records and all(x["event"] == "divergence" for x in records)
    assert records[0]["cause"]["cause"] != "structural", records[0]["cause"]
    healthy = records[0]["diagnosis"]["on_healthy_weights"]
    assert healthy["reproduced"] is False and healthy["state_setup"] == ["net.pts_bbox_head"]
    memory = r.model.net.pts_bbox_head.memory_embedding
    assert memory is None or bool(torch.isfinite(memory).all())
