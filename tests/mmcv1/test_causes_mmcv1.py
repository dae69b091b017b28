"""Cause-aware recovery end to end on real MMCV 1.x runners (PETR's and StreamPETR's family), CPU fp16 autocast.

The triggers are data or model behaviour (petr_stability/testing/causes_models.py), as in the MMEngine suite:
a sample with raw 16-bit pixels served every epoch, an attention core whose fp16 logits overflow, a wrong
transform from some call on, a NaN frame poisoning a StreamPETR-style memory.
"""
import logging
import math
import uuid
from typing import Any, List, Optional

import pytest
import torch
from harness import guard_hook, params_finite, run
from mmcv.runner import EpochBasedRunner, Hook, IterBasedRunner, build_optimizer
from torch.utils.data import DataLoader, default_collate

import petr_stability  # noqa: F401  (registers the hooks)
from petr_stability import read_incidents
from petr_stability.core.config import REMEDIES
from petr_stability.core.errors import BadDataError, NanGuardGaveUp
from petr_stability.core.remedies import fp32_modules, release_fp32
from petr_stability.testing.causes_models import (
    DropsSampleIds,
    IdentifiedDataset,
    build_memory_net,
    overflow_layer_cfg,
    sample_token,
)
from petr_stability.testing.mmcv1_cpu import PETRLikeMMCV1
from petr_stability.testing.petr_like import SEED_LAYER_CFG

# fp16 overflows and skipped steps land where the CPU kernels round: these run again under ATEN_CPU_CAPABILITY=default.
pytestmark = pytest.mark.numerics

MODEL = dict(num_layers=1, num_query=16, layer_cfg=SEED_LAYER_CFG)
N = 16
# Capacity 2 of 16 samples: the quarantine takes the failing batch (2 samples), no more.
GUARD = dict(snapshot_interval=4, confirm_steps=2, check_interval=4, quarantine_fraction=0.125)
BAD = 9  # served in the 5th iteration of every epoch (batch size 2, no shuffle)
CORE = "net.pts_bbox_head.layers.0.attentions.1.inner_attn"  # the fused kernel whose fp16 logits overflow
HEAD = "net.pts_bbox_head"


class IdsModel(DropsSampleIds, PETRLikeMMCV1):
    """PETRLikeMMCV1 taking the batch's ``sample_idx`` (its own forward rejects unknown keys)."""


class MemoryProbe(Hook):
    """After every iteration (after NanGuardHook: registered LOWEST): is the head's memory finite, is it there?"""

    def __init__(self) -> None:
        self.states: List[str] = []

    def after_train_iter(self, runner: Any) -> None:
        memory = runner.model.net.pts_bbox_head.memory_embedding
        self.states.append("none" if memory is None else "finite" if bool(torch.isfinite(memory).all()) else "nan")


def build(work_dir: str, dataset: IdentifiedDataset, runner: str = "epoch", max_epochs: int = 3, max_iters: int = 16,
          amp: Any = "dynamic", guard: Optional[dict] = None, net: Optional[torch.nn.Module] = None,
          model_kwargs: Optional[dict] = None, extra_hooks: Optional[List[Hook]] = None, lr: float = 2e-4) -> Any:
    """An MMCV 1.x runner over ``dataset`` (batch 2, no shuffle), hooks registered as mmdet3d 0.x does."""
    torch.manual_seed(0)
    model = IdsModel(**dict(MODEL, **(model_kwargs or {})))
    if net is not None:
        model.net = net
    optimizer = build_optimizer(model, dict(type="AdamW", lr=lr, weight_decay=0.01))
    logger = logging.getLogger(f"mmcv1-causes-{uuid.uuid4().hex[:8]}")
    logger.setLevel(logging.INFO)
    cls = EpochBasedRunner if runner == "epoch" else IterBasedRunner
    length = dict(max_epochs=max_epochs) if runner == "epoch" else dict(max_iters=max_iters)
    r = cls(model=model, optimizer=optimizer, work_dir=work_dir, logger=logger, meta={}, **length)
    r.register_training_hooks(
        dict(policy="fixed"),
        dict(type="CPUFp16OptimizerHook", loss_scale=amp, grad_clip=dict(max_norm=35, norm_type=2)),
        dict(interval=10 ** 6, by_epoch=runner == "epoch"),
        dict(interval=5, hooks=[dict(type="TextLoggerHook")]),
        custom_hooks_config=[dict(type="NanGuardHook", **dict(GUARD, **(guard or {})))],
    )
    for hook in extra_hooks or []:
        r.register_hook(hook, priority="LOWEST")
    r.loader = DataLoader(dataset, batch_size=2, shuffle=False)
    return r


def divergences(work_dir: str) -> List[dict]:
    return [rec for rec in read_incidents(work_dir) if rec["event"] in ("divergence", "gave_up")]


def test_sample_breaking_every_epoch_is_quarantined_once_and_named(tmp_path):
    wd = str(tmp_path)
    dataset = IdentifiedDataset(N, num_query=16, bad={BAD: "raw16"})
    r = build(wd, dataset, max_epochs=3)
    run(r)
    assert r.epoch == 3 and params_finite(r)
    records = divergences(wd)
    assert 1 <= len(records) <= 2 and all(rec["event"] == "divergence" for rec in records)
    rec = records[0]
    assert rec["iteration"] == 5 and rec["cause"]["cause"] == "data"
    assert rec["diagnosis"]["on_healthy_weights"]["reproduced"] is True
    assert {"sample_idx": sample_token(BAD), "index": BAD} in rec["cause"]["signals"]["quarantined"]
    assert BAD in guard_hook(r).guard.remedy("quarantine").skip_list
    # Data is not a hyperparameter problem: nothing but the quarantine changed.
    assert [a["target"] for a in rec["actions"]] == ["quarantine.samples"]
    assert r.model.net.pts_bbox_head.layers[0].attentions[1].attn.dropout == 0.1
    # The sampler wrapper goes in as epoch 1 runs (MMCV hands the loader over only then): epochs 2 and 3 skip it.
    assert dataset.served[BAD] == 1 and dataset.served[0] == 3


@pytest.mark.parametrize("lr_on_overflow", [True, False])
def test_a_too_high_rate_growing_the_logits_into_fp16_overflow_gets_fp32_and_a_lower_rate(tmp_path, lr_on_overflow):
    # Nothing planted: at lr 0.1 the cross attention's logits (gain 2e4) overflow fp16 on the start weights, and
    # after that is in fp32 the decoder layer's FFN grows until its fp16 forward overflows. Each overflow's replay
    # says whether the same batch is finite on the healthy weights: the start weights overflow too (no rate change),
    # the later one is finite on the snapshot (the weights grew into it): the decoder layer goes to fp32 and, by
    # default, the rate x 0.5 in the optimizer and MMCV's LrUpdaterHook bases. When the FFN overflows is emergent
    # numerics (iteration 25 or 26 with this CPU's kernels, AVX-512 or AVX2 or the portable ones): asserted is the
    # order and the answers, never the iteration.
    wd = str(tmp_path)
    r = build(wd, IdentifiedDataset(N, num_query=16), runner="iter", max_iters=40, lr=0.1,
              model_kwargs=dict(layer_cfg=overflow_layer_cfg(logit_gain=2e4)),
              guard=dict(lr_on_overflow=lr_on_overflow))
    run(r)
    assert r.iter == 40 and params_finite(r)
    records = sorted(divergences(wd), key=lambda rec: rec["iteration"])
    seen = [(rec["iteration"], rec["cause"]["signals"].get("weights_grew")) for rec in records]
    assert records and all(rec["cause"]["cause"] == "forward_overflow" for rec in records), seen
    assert records[0]["cause"]["signals"]["weights_grew"] is False, seen  # the start weights overflow too
    grew = [rec for rec in records if rec["cause"]["signals"]["weights_grew"]]
    assert len(grew) == 1 and grew[0]["iteration"] > records[0]["iteration"], seen
    assert "the same batch stays finite in fp16: the weights grew into the overflow" in grew[0]["cause"]["evidence"]
    # The state where the FFN's skip streak began is the grown one: the run goes back to a confirmed snapshot, one of
    # the snapshot clock's (every snapshot_interval-th iteration), not to where the scaler first skipped.
    back = grew[0]["restored_from"]
    assert back["source"] == "memory" and back["iteration"] % GUARD["snapshot_interval"] == 0, back
    assert 0 < back["iteration"] < grew[0]["iteration"] - GUARD["confirm_steps"], back
    lr_targets = ["optimizer0.group0.lr", "optimizer0.group0.initial_lr", "FixedLrUpdaterHook.base_lr",
                  "FixedLrUpdaterHook.regular_lr"]
    for rec in records:
        targets = [a["target"] for a in rec["actions"]]
        assert targets[0] == rec["cause"]["modules"][0], targets  # the module in fp32 first, always
        assert targets[1:] == (lr_targets if lr_on_overflow and rec in grew else []), (rec["iteration"], targets)
    assert grew[0]["cause"]["modules"][0] in fp32_modules(r.model)
    assert r.optimizer.param_groups[0]["lr"] == (0.05 if lr_on_overflow else 0.1)
    assert guard_hook(r).guard.remedy("lr").lr_factor == (0.5 if lr_on_overflow else 1.0)


def test_attention_overflowing_fp16_runs_in_fp32_afterwards(tmp_path):
    wd = str(tmp_path)
    # Every batch overflows the attention core's fp16 logits; the scaler backs off 8 -> 0.5, below 1: diverged.
    r = build(wd, IdentifiedDataset(N, num_query=16), runner="iter", max_iters=16, amp=dict(init_scale=8.0),
              model_kwargs=dict(layer_cfg=overflow_layer_cfg()))
    run(r)
    assert r.iter == 16 and params_finite(r)
    (rec,) = divergences(wd)
    assert rec["cause"]["cause"] == "forward_overflow" and rec["cause"]["modules"] == [CORE]
    assert rec["diagnosis"]["fp32_check"]["fixed_by"] == CORE
    # Every batch overflows, on the healthy weights too: the weights did not grow into it, no rate changes.
    assert rec["cause"]["signals"]["weights_grew"] is False and not [a for a in rec["actions"] if ".lr" in a["target"]]
    assert fp32_modules(r.model) == [CORE] and guard_hook(r).guard.remedy("fp32").fp32 == [CORE]
    assert r.meta["nan_guard"]["remedies"]["fp32"]["fp32"] == [CORE]  # persisted for a resume
    # The trained model: the core is finite (fp32) under the model's fp16 autocast, and overflows once released.
    core = r.model.get_submodule(CORE)
    seen = []
    core.register_forward_hook(lambda m, a, out: seen.append((out.dtype, bool(torch.isfinite(out).all()))))
    batch = default_collate([r.loader.dataset[i] for i in range(2)])
    with torch.no_grad():
        r.model(**batch)
        release_fp32(core)
        r.model(**batch)
    assert seen == [(torch.float32, True), (torch.float16, False)]


def test_wrong_transform_on_every_batch_stops_as_a_data_problem_naming_the_samples(tmp_path):
    wd = str(tmp_path)
    # The first 8 samples (iterations 1-4) are served right; from then on every sample is +/-Inf (a wrong transform):
    # bad data batch after batch by the evidence, never "a bug" by a timing rule; once the recovery budget is spent
    # on it the run stops as a data problem naming every bad sample, with no hyperparameter changed.
    r = build(wd, IdentifiedDataset(N, num_query=16, bug_after=8), max_epochs=3)
    with pytest.raises(BadDataError, match="a data problem, not a bug") as err:
        run(r)
    assert "data pipeline's transforms" in str(err.value) and err.value.samples
    *incidents, last = divergences(wd)
    assert last["event"] == "gave_up" and len(incidents) == 5
    assert all(rec["cause"]["cause"] == "data" for rec in incidents)
    assert not [a for rec in incidents for a in rec["actions"] if not a["target"].startswith("quarantine")]
    assert params_finite(r)


def test_nan_frame_poisoning_the_memory_is_reset_after_the_rollback(tmp_path):
    wd = str(tmp_path)
    probe = MemoryProbe()
    r = build(wd, IdentifiedDataset(N, num_query=16, bad={BAD: "nan"}), max_epochs=2,
              net=build_memory_net(num_layers=1, num_query=16), extra_hooks=[probe])
    run(r)
    assert r.epoch == 2 and params_finite(r)
    (rec,) = divergences(wd)
    assert rec["iteration"] == 5 and rec["cause"]["cause"] == "data"
    assert rec["restored_from"]["temporal_reset"] == [HEAD]
    # Reset right after the rollback, then rebuilt from healthy frames only: never NaN again.
    assert probe.states[4] == "none" and probe.states[5:] and set(probe.states[5:]) == {"finite"}
    memory = r.model.net.pts_bbox_head.memory_embedding
    assert memory is not None and bool(torch.isfinite(memory).all())


def test_without_the_temporal_reset_the_poisoned_memory_stays_nan(tmp_path):
    # The counterfactual of the test above: the same run with every remedy but 'temporal'.
    wd = str(tmp_path)
    probe = MemoryProbe()
    r = build(wd, IdentifiedDataset(N, num_query=16, bad={BAD: "nan"}), max_epochs=2,
              net=build_memory_net(num_layers=1, num_query=16), extra_hooks=[probe],
              guard=dict(remedies=[name for name in REMEDIES if name != "temporal"]))
    with pytest.raises(NanGuardGaveUp):  # the full health check finds the memory NaN again after every rollback
        run(r)
    assert probe.states[4] == "nan"
    assert not math.isfinite(float(r.model.net.pts_bbox_head.memory_embedding.abs().max()))
    later = [rec for rec in read_incidents(wd) if rec.get("nonfinite_attributes")]
    assert later and later[0]["nonfinite_attributes"] == ["net.pts_bbox_head.memory_embedding"]
