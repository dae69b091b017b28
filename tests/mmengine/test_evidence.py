"""The evidence rule on a real MMEngine runner (issue 32): a sample is blamed only by evidence about that sample,
never by having been in a batch that overflowed or was skipped. A too-high learning rate breaks whole batches and
blames nobody; a sample whose own target is degenerate is named alone, even beside the same batch-mates every
epoch; two such samples in one batch are both named."""
import os
import uuid
from collections import Counter
from typing import Any, Optional

import pytest
import torch
from mmengine.model import BaseModel
from mmengine.runner import Runner

import petr_stability  # noqa: F401  (registers the hooks)
import petr_stability.testing.mmengine_cpu  # noqa: F401  (CPUAmpOptimWrapper)
from petr_stability import read_incidents
from petr_stability.core.recovery.chain import ISOLATED
from petr_stability.testing.dense import DenseData, dense_loss, dense_net

GUARD = dict(snapshot_interval=4, confirm_steps=2, check_interval=4)


class Dense(BaseModel):
    def __init__(self) -> None:
        super().__init__()
        self.net = dense_net()

    def forward(self, inputs: torch.Tensor, target: torch.Tensor, sample_idx: Any = None, mode: str = "loss") -> dict:
        return {"loss": dense_loss(self.net, inputs, target)}


def build(work_dir: str, data: DenseData, lr: float, epochs: int, amp: bool, shuffle: bool,
          guard: Optional[dict] = None) -> Runner:
    wrapper = dict(type="CPUAmpOptimWrapper", loss_scale="dynamic") if amp else dict(type="OptimWrapper")
    wrapper.update(optimizer=dict(type="Adam", lr=lr), clip_grad=dict(max_norm=35, norm_type=2))
    hooks = [dict(type="NanGuardHook", **dict(GUARD, **(guard or {})))]
    return Runner(
        model=Dense(), work_dir=work_dir, experiment_name=f"t{uuid.uuid4().hex[:10]}",
        train_dataloader=dict(dataset=data, sampler=dict(type="DefaultSampler", shuffle=shuffle), batch_size=4,
                              num_workers=0, collate_fn=dict(type="default_collate")),
        optim_wrapper=wrapper, train_cfg=dict(by_epoch=True, max_epochs=epochs),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=10 ** 6)),
        default_scope="mmengine", randomness=dict(seed=0), log_level="WARNING", custom_hooks=hooks,
        cfg=dict(model=dict(type="Dense"), optim_wrapper=wrapper, custom_hooks=hooks))  # what a config file holds


def guard_of(runner: Runner) -> Any:
    return next(h for h in runner.hooks if type(h).__name__ == "NanGuardHook").guard


def test_a_too_high_learning_rate_breaks_whole_batches_and_blames_no_sample(tmp_path):
    # Adam at 30 in fp16: forwards overflow batch after batch (the loss itself is Inf); the ladder's learning-rate
    # rung (backoff 0.01) ends it. Every batch that broke is listed; no sample is named, quarantined or refused.
    wd = str(tmp_path)
    runner = build(wd, DenseData(8), lr=30.0, epochs=6, amp=True, shuffle=True, guard=dict(lr_backoff=0.01))
    runner.train()
    records = read_incidents(wd)
    skips = [r for r in records if r["event"] == "skip"]
    assert len(skips) >= 2 and all(len(r["batch"]) == 4 and r["samples"] == [] for r in skips)  # it broke, often
    assert all((r.get("cause") or {}).get("cause") != "data" for r in records)
    quarantine = guard_of(runner).remedy("quarantine")
    assert not quarantine.skip_list and quarantine.refused_samples == {} and quarantine.sightings == {}
    assert runner.train_dataloader.dataset.last_pass() == list(range(8))  # every sample served in the last epoch
    patched = os.path.join(wd, "nan_guard_patched_config.py")
    assert os.path.isfile(patched) and "quarantine" not in open(patched).read()


def test_a_sample_with_degenerate_targets_is_named_alone_beside_the_same_batch_mates(tmp_path):
    # fp32, no shuffle: the degenerate sample meets the same three batch-mates every epoch. Its own values are finite
    # (not flagged); replayed row by row from the healthy state, it alone breaks: named at two skipped steps (two
    # epochs), quarantined; the batch-mates never named.
    wd = str(tmp_path)
    runner = build(wd, DenseData(16, degenerate=[9]), lr=1e-3, epochs=4, amp=False, shuffle=False)
    runner.train()
    records = read_incidents(wd)
    skips = [r for r in records if r["event"] == "skip"]
    assert [r["batch"] and len(r["batch"]) for r in skips] == [4, 4]  # the whole batch is listed: it broke
    assert all(r["samples"] == [{"index": 9, "sample_idx": "tok009", "evidence": ISOLATED}] for r in skips)
    (rec,) = [r for r in records if r["event"] == "recurring_sample"]
    assert rec["batch"] == [{"index": 9, "sample_idx": "tok009"}] and rec["quarantined"] is True
    assert list(guard_of(runner).remedy("quarantine").skip_list) == [9]
    counts = Counter(runner.train_dataloader.dataset.fetches)
    # Its slot is filled by the index the same slot of the previous batch held, in the last two epochs.
    assert counts.pop(9) == 2 and sorted(counts.values()) == [4] * 14 + [6]


@pytest.mark.parametrize("pair", [(8, 9), (8, 11)], ids=["adjacent", "apart"])
def test_two_bad_samples_in_one_batch_are_both_named(tmp_path, pair):
    wd = str(tmp_path)
    runner = build(wd, DenseData(16, degenerate=pair), lr=1e-3, epochs=3, amp=False, shuffle=False,
                   guard=dict(quarantine_fraction=0.25))
    runner.train()
    skips = [r for r in read_incidents(wd) if r["event"] == "skip"]
    assert skips and all(sorted(s["index"] for s in r["samples"]) == list(pair) for r in skips)
    assert sorted(guard_of(runner).remedy("quarantine").skip_list) == list(pair)
