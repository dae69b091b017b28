"""Cause-aware recovery end to end in a real MMEngine Runner on the PETR-shaped model (CPU fp16 autocast).

Every trigger is data or model behaviour (petr_stability/testing/causes_models.py), never a write into the
weights: a sample with raw 16-bit pixels served every epoch (data: quarantined), an attention whose fp16 logits
overflow (forward overflow: that module in fp32), a wrong transform in the dataset from some call on (a bug:
structural), a NaN frame poisoning a StreamPETR-style memory (the memory reset after the rollback).
"""
import math
import uuid
from typing import Any, List, Optional

import pytest
import torch
from harness import guard_hook, params_finite
from mmengine.hooks import Hook
from mmengine.runner import Runner
from torch.utils.data import default_collate

import petr_stability  # noqa: F401  (registers the hooks)
from petr_stability import read_incidents
from petr_stability.core.errors import BadDataError, NanGuardGaveUp
from petr_stability.core.remedies import fp32_modules, release_fp32
from petr_stability.testing.causes_models import (
    DropsSampleIds,
    IdentifiedDataset,
    build_memory_net,
    overflow_layer_cfg,
    sample_token,
)
from petr_stability.testing.mmengine_cpu import PETRLikeModel

# fp16 overflows and skipped steps land where the CPU kernels round: these run again under ATEN_CPU_CAPABILITY=default.
pytestmark = pytest.mark.numerics

SMALL = dict(num_layers=1, num_query=16)
N = 16
# Capacity 2 of 16 samples: the quarantine takes the failing batch (2 samples), no more.
GUARD = dict(snapshot_interval=4, confirm_steps=2, check_interval=4, quarantine_fraction=0.125)
BAD = 9  # served in the 5th iteration of every epoch (batch size 2, no shuffle)
CROSS_ATTN = "net.pts_bbox_head.layers.0.attentions.1"
CORE = CROSS_ATTN + ".inner_attn"  # the fused kernel module whose fp16 logits overflow
HEAD = "net.pts_bbox_head"


class IdsModel(DropsSampleIds, PETRLikeModel):
    """PETRLikeModel taking the batch's ``sample_idx`` (its own forward rejects unknown keys)."""


class MemoryProbe(Hook):
    """After every iteration (after NanGuardHook: LOW runs later): is the head's memory finite, and is it there?"""

    priority = "LOW"

    def __init__(self) -> None:
        self.states: List[str] = []

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        memory = runner.model.net.pts_bbox_head.memory_embedding
        self.states.append("none" if memory is None else "finite" if bool(torch.isfinite(memory).all()) else "nan")


def build(work_dir: str, dataset: IdentifiedDataset, guard: Optional[dict] = None, max_epochs: Optional[int] = None,
          max_iters: Optional[int] = None, amp: Any = "dynamic", net: Optional[torch.nn.Module] = None,
          model_kwargs: Optional[dict] = None, extra_hooks: Optional[List[Hook]] = None) -> Runner:
    """An MMEngine runner over ``dataset`` (batch 2, no shuffle) with the PETR-shaped model (or ``net``)."""
    torch.manual_seed(0)
    model = IdsModel(**dict(SMALL, **(model_kwargs or {})))
    if net is not None:
        model.net = net
    by_epoch = max_epochs is not None
    runner = Runner(
        model=model,
        work_dir=work_dir,
        experiment_name=f"t{uuid.uuid4().hex[:10]}",
        train_dataloader=dict(dataset=dataset, sampler=dict(type="DefaultSampler", shuffle=False), batch_size=2,
                              num_workers=0, collate_fn=dict(type="default_collate")),
        optim_wrapper=dict(type="CPUAmpOptimWrapper", loss_scale=amp, clip_grad=dict(max_norm=35, norm_type=2),
                           optimizer=dict(type="AdamW", lr=2e-4, weight_decay=0.01)),
        train_cfg=dict(by_epoch=True, max_epochs=max_epochs) if by_epoch else dict(by_epoch=False,
                                                                                  max_iters=max_iters),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=10 ** 6, by_epoch=by_epoch),
                           logger=dict(type="LoggerHook", interval=5)),
        log_processor=dict(by_epoch=by_epoch),
        custom_hooks=[dict(type="NanGuardHook", **dict(GUARD, **(guard or {})))],
        default_scope="mmengine",
        randomness=dict(seed=0),
        log_level="WARNING",
    )
    for hook in extra_hooks or []:
        runner.register_hook(hook)
    return runner


def divergences(work_dir: str) -> List[dict]:
    return [r for r in read_incidents(work_dir) if r["event"] in ("divergence", "gave_up")]


def test_sample_breaking_every_epoch_is_quarantined_once_and_named(tmp_path):
    wd = str(tmp_path)
    dataset = IdentifiedDataset(N, num_query=16, bad={BAD: "raw16"})
    runner = build(wd, dataset, max_epochs=3)
    runner.train()
    assert runner.epoch == 3 and params_finite(runner)
    records = divergences(wd)
    assert 1 <= len(records) <= 2 and all(r["event"] == "divergence" for r in records)
    rec = records[0]
    assert rec["iteration"] == 5 and rec["cause"]["cause"] == "data"
    # 65535 is finite in fp32 and past fp16's 65504: the backbone's fp16 projection turns it into Inf, and the
    # same batch breaks the healthy weights too.
    assert rec["diagnosis"]["on_healthy_weights"]["reproduced"] is True
    assert {"sample_idx": sample_token(BAD), "index": BAD} in rec["cause"]["signals"]["quarantined"]
    assert BAD in guard_hook(runner).guard.remedy("quarantine").skip_list
    # Data is not a hyperparameter problem: nothing but the quarantine changed.
    assert [a["target"] for a in rec["actions"]] == ["quarantine.samples"]
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 35
    assert runner.model.net.pts_bbox_head.layers[0].attentions[1].attn.dropout == 0.1
    # Epochs 2 and 3 never served the sample again (the runner serves a copy of the dataset config's object).
    served = runner.train_dataloader.dataset.served
    assert served[BAD] == 1 and served[0] == 3


def test_attention_overflowing_fp16_runs_in_fp32_afterwards(tmp_path):
    wd = str(tmp_path)
    # Every batch overflows the cross attention's fp16 logits; the scaler backs off 8 -> 0.5, below 1: diverged.
    runner = build(wd, IdentifiedDataset(N, num_query=16), max_iters=16, amp=dict(init_scale=8.0),
                   model_kwargs=dict(layer_cfg=overflow_layer_cfg()))
    runner.train()
    assert runner.iter == 16 and params_finite(runner)
    (rec,) = divergences(wd)
    assert rec["cause"]["cause"] == "forward_overflow" and rec["cause"]["modules"] == [CORE]
    check = rec["diagnosis"]["fp32_check"]
    assert check["module"] == CORE and check["fixed_by"] == CORE and check["max_abs"] < 65504
    assert fp32_modules(runner.model) == [CORE]
    assert guard_hook(runner).guard.remedy("fp32").fp32 == [CORE]
    # Not the ladder: no hyperparameter changed. Every batch overflows, on the healthy weights too: the weights did
    # not grow into it, so the learning rate stays (lr_on_overflow answers only the overflow they grew into).
    assert runner.optim_wrapper.clip_grad_kwargs["max_norm"] == 35
    assert rec["cause"]["signals"]["weights_grew"] is False and "grew" not in rec["cause"]["evidence"]
    assert [g["lr"] for g in runner.optim_wrapper.optimizer.param_groups] == [2e-4]
    # The trained model: the core is finite (fp32) under fp16 autocast, and overflows once released.
    core = runner.model.get_submodule(CORE)
    seen = []
    core.register_forward_hook(lambda m, a, out: seen.append((out.dtype, bool(torch.isfinite(out).all()))))
    batch = default_collate([runner.train_dataloader.dataset[i] for i in range(2)])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        runner.model.net.losses(batch["inputs"], batch["cls_t"], batch["reg_t"])
        release_fp32(core)
        runner.model.net.losses(batch["inputs"], batch["cls_t"], batch["reg_t"])
    assert seen == [(torch.float32, True), (torch.float16, False)]


@pytest.mark.parametrize("fraction", [0.125, 0.001])
def test_wrong_transform_on_every_batch_stops_as_a_data_problem_naming_the_samples(tmp_path, fraction):
    wd = str(tmp_path)
    # The first 8 samples (iterations 1-4) are served right; from then on every sample is +/-Inf (a wrong transform).
    # Every batch is bad data by the evidence (its own values, and the batch known to be good trains fine): each is
    # quarantined within the bound or refused and skipped, never "a bug" by a timing rule; once the recovery budget
    # is spent on bad data the run stops as a data problem, naming every bad sample, with nothing else changed.
    dataset = IdentifiedDataset(N, num_query=16, bug_after=8)
    runner = build(wd, dataset, max_epochs=3, guard=dict(quarantine_fraction=fraction))
    with pytest.raises(BadDataError, match="a data problem, not a bug") as err:
        runner.train()
    assert "data pipeline's transforms" in str(err.value)
    records = divergences(wd)
    *incidents, last = records
    assert last["event"] == "gave_up" and len(incidents) == 5
    assert all(r["cause"]["cause"] == "data" for r in incidents)
    assert not [a for r in incidents for a in r["actions"] if not a["target"].startswith("quarantine")]
    refused = [r for r in incidents if r["cause"]["signals"].get("refused")]
    assert refused and "refused, not quarantined; the batch is skipped" in refused[0]["cause"]["evidence"]
    assert len(err.value.samples) >= 2 * len(refused)  # every sample of every bad batch, named
    assert params_finite(runner)  # the runner's weights are left finite


def test_nan_frame_poisoning_the_memory_is_reset_after_the_rollback(tmp_path):
    wd = str(tmp_path)
    probe = MemoryProbe()
    runner = build(wd, IdentifiedDataset(N, num_query=16, bad={BAD: "nan"}), max_epochs=2,
                   net=build_memory_net(**SMALL), extra_hooks=[probe])
    runner.train()
    assert runner.epoch == 2 and params_finite(runner)
    (rec,) = divergences(wd)
    assert rec["iteration"] == 5 and rec["cause"]["cause"] == "data"
    assert rec["restored_from"]["temporal_reset"] == [HEAD]
    # Reset right after the rollback, then rebuilt from healthy frames only: never NaN again.
    assert probe.states[4] == "none" and probe.states[5:] and set(probe.states[5:]) == {"finite"}
    memory = runner.model.net.pts_bbox_head.memory_embedding
    assert memory is not None and bool(torch.isfinite(memory).all())


def test_without_the_temporal_reset_the_poisoned_memory_stays_nan(tmp_path):
    # The counterfactual of the test above: the same run with every remedy but 'temporal'.
    wd = str(tmp_path)
    probe = MemoryProbe()
    remedies = [r for r in petr_stability.core.config.REMEDIES if r != "temporal"]
    runner = build(wd, IdentifiedDataset(N, num_query=16, bad={BAD: "nan"}), max_epochs=2,
                   net=build_memory_net(**SMALL), extra_hooks=[probe], guard=dict(remedies=remedies))
    try:
        runner.train()
    except Exception:  # noqa: BLE001  (whether it gives up or not, the memory is what this test reads)
        pass
    assert probe.states[4] == "nan"  # the NaN frame poisoned the memory; no rollback clears it without the reset
    assert not math.isfinite(float(runner.model.net.pts_bbox_head.memory_embedding.abs().max()))


def test_a_memory_left_nan_is_reported_by_the_health_checks(tmp_path):
    wd = str(tmp_path)
    remedies = [r for r in petr_stability.core.config.REMEDIES if r != "temporal"]
    runner = build(wd, IdentifiedDataset(N, num_query=16, bad={BAD: "nan"}), max_epochs=2,
                   net=build_memory_net(**SMALL), guard=dict(remedies=remedies))
    with pytest.raises(NanGuardGaveUp):  # the state a rollback cannot reach stays poisoned: the run stops
        runner.train()
    assert runner.model.net.pts_bbox_head.memory_embedding.isnan().any()  # the premise: left NaN
    later = read_incidents(wd)[1:]
    assert later and later[0]["nonfinite_attributes"] == ["net.pts_bbox_head.memory_embedding"]


def test_overflow_in_an_attentions_own_forward_code_is_a_forward_overflow(tmp_path):
    # The same overflow computed by plain calls inside the attention's forward (no kernel module around it), as
    # attentions written with functional calls do: the first non-finite value a module hook sees is the fp16 input
    # of the output projection, produced inside CROSS_ATTN's forward from finite inputs.
    wd = str(tmp_path)
    runner = build(wd, IdentifiedDataset(N, num_query=16), max_iters=16, amp=dict(init_scale=8.0),
                   model_kwargs=dict(layer_cfg=overflow_layer_cfg(fused=False)))
    runner.train()
    (rec,) = divergences(wd)
    assert rec["cause"]["cause"] == "forward_overflow" and rec["cause"]["modules"] == [CROSS_ATTN]
    assert runner.iter == 16 and fp32_modules(runner.model) == [CROSS_ATTN]


def test_a_refused_quarantine_names_no_sample_as_quarantined(tmp_path):
    wd = str(tmp_path)
    # 2 samples per batch, a bound of 1: the skip list refuses each bad batch; it is skipped and the run goes on to
    # the end of its epoch (the refused samples do not come back within it).
    runner = build(wd, IdentifiedDataset(N, num_query=16, bug_after=8), max_epochs=1,
                   guard=dict(quarantine_fraction=0.001))
    runner.train()
    assert runner.epoch == 1 and params_finite(runner)
    records = divergences(wd)
    assert records and all(r["event"] == "divergence" for r in records)
    rec = records[0]
    assert "would pass the bound" in rec["cause"]["evidence"] and rec["cause"]["cause"] == "data"
    assert len(guard_hook(runner).guard.remedy("quarantine").skip_list) == 0
    assert not rec["cause"]["signals"].get("quarantined") and rec["cause"]["signals"]["refused"]
    assert all(r["actions"] == [] for r in records)


@pytest.mark.parametrize("kwargs,message", [
    (dict(bad={16: "nan"}), "bad sample index must be an integer in [0, 16), got 16"),
    (dict(bad={3: "dark"}), "bad sample kind must be one of ['raw16', 'nan', 'inf'], got 'dark'"),
    (dict(bug_after=-1), "bug_after must be None or an integer >= 0, got -1"),
    (dict(bad_tokens=0), "bad_tokens must be an integer >= 1, got 0"),
])
def test_identified_dataset_names_the_bad_argument(kwargs, message):
    with pytest.raises(ValueError) as err:
        IdentifiedDataset(N, **kwargs)
    assert str(err.value) == message


def test_identified_dataset_triggers_are_in_the_data():
    dataset = IdentifiedDataset(4, num_query=16, bad={1: "raw16", 2: "nan"}, bug_after=4)
    first, raw16, nan = dataset[0], dataset[1]["inputs"], dataset[2]["inputs"]
    assert bool(torch.isfinite(first["inputs"]).all()) and first["sample_idx"] == sample_token(0) == "sample-0000-tok"
    assert float(raw16.max()) == 65535.0 and bool(torch.isinf(raw16.half()).any())  # finite, but not in fp16
    assert bool(nan[:4].isnan().all()) and bool(torch.isfinite(nan[4:]).all())
    assert bool(torch.isfinite(dataset[3]["inputs"]).all()) and dataset.calls == 4
    assert not bool(torch.isfinite(dataset[0]["inputs"]).any())  # the 5th call: the wrong transform, any sample
    assert dataset.served == {0: 2, 1: 1, 2: 1, 3: 1}
    assert dataset.data_infos[3] == {"sample_idx": sample_token(3)} and dataset.data_list is dataset.data_infos
