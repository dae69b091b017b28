"""The evidence rule on a real MMCV 1.x runner (issue 32): a sample is blamed only by evidence about that sample,
never by having been in a batch that overflowed or was skipped (the issue measured the harm on this family: a
too-high learning rate, fp16 dynamic, had innocent samples named and the run stopped as bad data)."""
import logging
import os
import uuid
from collections import Counter
from typing import Any, Dict, Optional

import pytest
import torch
from mmcv.runner import EpochBasedRunner, build_optimizer
from torch import nn
from torch.utils.data import DataLoader

import petr_stability  # noqa: F401  (registers the hooks)
import petr_stability.testing.mmcv1_cpu  # noqa: F401  (CPUFp16OptimizerHook)
from petr_stability import read_incidents
from petr_stability.core.recovery.chain import ISOLATED
from petr_stability.testing.dense import DenseData, dense_loss, dense_net

GUARD = dict(snapshot_interval=4, confirm_steps=2, check_interval=4)


class Dense(nn.Module):
    """The dense regressor behind MMCV 1.x's ``train_step``; fp16 under CPU autocast once ``wrap_fp16_model`` sets
    ``fp16_enabled``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = dense_net()
        self.fp16_enabled = False

    def forward(self, inputs: torch.Tensor, target: torch.Tensor, sample_idx: Any = None) -> Dict[str, Any]:
        with torch.autocast("cpu", dtype=torch.float16, enabled=self.fp16_enabled):
            return {"loss": dense_loss(self.net, inputs, target)}

    def train_step(self, data: Dict[str, Any], optimizer: Any = None, **kwargs: Any) -> Dict[str, Any]:
        loss = self(**data)["loss"]
        return dict(loss=loss, log_vars={"loss": float(loss)}, num_samples=int(data["inputs"].shape[0]))


def build(work_dir: str, data: DenseData, lr: float, epochs: int, amp: bool, shuffle: bool,
          guard: Optional[dict] = None) -> Any:
    torch.manual_seed(0)
    model = Dense()
    logger = logging.getLogger(f"mmcv1-evidence-{uuid.uuid4().hex[:8]}")
    hooks = [dict(type="NanGuardHook", **dict(GUARD, **(guard or {})))]
    clip = dict(max_norm=35, norm_type=2)
    optimizer_config = (dict(type="CPUFp16OptimizerHook", loss_scale="dynamic", grad_clip=clip) if amp else
                        dict(type="OptimizerHook", grad_clip=clip))
    cfg = dict(model=dict(type="Dense"), optimizer=dict(type="Adam", lr=lr), optimizer_config=optimizer_config,
               custom_hooks=hooks)  # what the config file holds: the patched config is written from it
    r = EpochBasedRunner(model=model, optimizer=build_optimizer(model, dict(type="Adam", lr=lr)), work_dir=work_dir,
                         logger=logger, meta={"config": "\n".join(f"{k} = {v!r}" for k, v in cfg.items())},
                         max_epochs=epochs)
    r.register_training_hooks(dict(policy="fixed"), optimizer_config, dict(interval=10 ** 6),
                              dict(interval=5, hooks=[dict(type="TextLoggerHook")]), custom_hooks_config=hooks)
    r.loader = DataLoader(data, batch_size=4, shuffle=shuffle, generator=torch.Generator().manual_seed(0))
    return r


def train(r: Any) -> None:
    r.run([r.loader], [("train", 1)])


def guard_of(r: Any) -> Any:
    return next(h for h in r.hooks if type(h).__name__ == "NanGuardHook").guard


def test_a_too_high_learning_rate_breaks_whole_batches_and_blames_no_sample(tmp_path):
    wd = str(tmp_path)
    r = build(wd, DenseData(8), lr=30.0, epochs=6, amp=True, shuffle=True, guard=dict(lr_backoff=0.01))
    train(r)
    records = read_incidents(wd)
    skips = [x for x in records if x["event"] == "skip"]
    assert len(skips) >= 2 and all(len(x["batch"]) == 4 and x["samples"] == [] for x in skips)  # it broke, often
    assert all((x.get("cause") or {}).get("cause") != "data" for x in records)
    quarantine = guard_of(r).remedy("quarantine")
    assert not quarantine.skip_list and quarantine.refused_samples == {} and quarantine.sightings == {}
    assert r.loader.dataset.last_pass() == list(range(8))  # every sample served in the last epoch
    patched = os.path.join(wd, "nan_guard_patched_config.py")
    assert os.path.isfile(patched) and "quarantine" not in open(patched).read()


def test_a_sample_with_degenerate_targets_is_named_alone_beside_the_same_batch_mates(tmp_path):
    wd = str(tmp_path)
    r = build(wd, DenseData(16, degenerate=[9]), lr=1e-3, epochs=4, amp=False, shuffle=False)
    train(r)
    records = read_incidents(wd)
    skips = [x for x in records if x["event"] == "skip"]
    assert [len(x["batch"]) for x in skips] == [4, 4]
    assert all(x["samples"] == [{"index": 9, "sample_idx": "tok009", "evidence": ISOLATED}] for x in skips)
    (rec,) = [x for x in records if x["event"] == "recurring_sample"]
    assert rec["batch"] == [{"index": 9, "sample_idx": "tok009"}] and rec["quarantined"] is True
    assert list(guard_of(r).remedy("quarantine").skip_list) == [9]
    counts = Counter(r.loader.dataset.fetches)
    assert counts.pop(9) == 2 and sorted(counts.values()) == [4] * 14 + [6]


@pytest.mark.parametrize("pair", [(8, 9), (8, 11)], ids=["adjacent", "apart"])
def test_two_bad_samples_in_one_batch_are_both_named(tmp_path, pair):
    wd = str(tmp_path)
    r = build(wd, DenseData(16, degenerate=pair), lr=1e-3, epochs=3, amp=False, shuffle=False,
              guard=dict(quarantine_fraction=0.25))
    train(r)
    skips = [x for x in read_incidents(wd) if x["event"] == "skip"]
    assert skips and all(sorted(s["index"] for s in x["samples"]) == list(pair) for x in skips)
    assert sorted(guard_of(r).remedy("quarantine").skip_list) == list(pair)
