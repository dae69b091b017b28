"""Snapshot ring, host copies, incident log, safe loading and fault planting."""
import copy
import math
import os
import pickle
import warnings

import pytest
import torch
from torch import nn

from petr_stability.adapters.mmengine_runner.checkpoints import load_mmengine_checkpoint
from petr_stability.core.errors import UnsafeCheckpointError
from petr_stability.core.faults import Fault, arm_grad_fault, parse_faults, poison_batch, poison_loss, poison_weights
from petr_stability.core.flags import HAS_SAFE_GLOBALS
from petr_stability.core.records import IncidentLog, read_incidents
from petr_stability.core.recovery.snapshot import Snapshot, SnapshotRing, copy_to_host
from petr_stability.core.safe_load import safe_load
from petr_stability.core.tree import iter_tensors
from petr_stability.core.tree import nbytes as payload_nbytes


def snap(i):
    return Snapshot(i, 0, {"w": torch.full((2,), float(i))})


def test_ring_confirms_after_w_clean_steps_and_keeps_newest_confirmed():
    ring = SnapshotRing(keep=2, confirm_steps=2)
    a = snap(0)
    ring.add(a)
    ring.tick()
    assert ring.newest_confirmed() is None
    ring.tick()
    assert ring.newest_confirmed() is a
    b, c = snap(5), snap(10)
    ring.add(b)
    ring.add(c)  # b is pending and not the newest confirmed: b is evicted, a survives
    assert ring.snapshots == [a, c]
    assert ring.discard_unconfirmed() == 1 and ring.snapshots == [a]


def test_ring_recycles_evicted_buffers():
    ring = SnapshotRing(keep=2, confirm_steps=0)
    ring.add(snap(0))
    ring.add(snap(1))
    reuse = ring.recyclable()
    assert reuse is ring.snapshots[0].payload
    out = copy_to_host({"w": torch.full((2,), 7.0)}, reuse=reuse)
    assert out["w"] is reuse["w"] and out["w"].tolist() == [7.0, 7.0]


@pytest.mark.parametrize("bad", [1, 0, True, 2.0])
def test_ring_bad_keep(bad):
    with pytest.raises(ValueError, match=f"keep_snapshots must be an integer >= 2, got {bad!r}"):
        SnapshotRing(keep=bad)


def test_copy_to_host_is_deep_and_keeps_structure():
    m = nn.BatchNorm1d(3)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"model": m.state_dict(), "opt": opt.state_dict(), "meta": {"iter": 3, "nested": [1, (2, 3)]}}
    copied = copy_to_host(state)
    assert type(copied["model"]) is type(state["model"])  # OrderedDict stays OrderedDict
    m.weight.data.add_(1.0)
    assert not torch.equal(copied["model"]["weight"], m.weight)
    copied["meta"]["nested"][0] = 99
    assert state["meta"]["nested"][0] == 1
    assert payload_nbytes(copied) > 0


def test_incident_log_rank0_only_and_tolerates_torn_line(tmp_path):
    IncidentLog(str(tmp_path), enabled=False).write({"event": "x"})
    assert not os.path.exists(tmp_path / "nan_guard_incidents.jsonl")
    log = IncidentLog(str(tmp_path))
    log.write({"event": "divergence", "value": math.nan})
    with open(log.path, "a") as f:
        f.write('{"event": "torn')
    with pytest.warns(RuntimeWarning, match=r"skipped 1 unusable line.*:2: a torn line"):
        recs = read_incidents(str(tmp_path))
    assert [r["event"] for r in recs] == ["divergence"] and "time" in recs[0]
    os.makedirs(tmp_path / "healthy")
    assert read_incidents(str(tmp_path / "healthy")) == []  # a run without incidents has no log
    with pytest.raises(FileNotFoundError, match="absent"):
        read_incidents(str(tmp_path / "absent"))  # a wrong path is an error, not an empty run


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_safe_load_refuses_malicious_pickle_and_says_why(tmp_path):
    path = str(tmp_path / "evil.pth")
    torch.save({"state_dict": {}, "payload": Boom()}, path)
    with pytest.raises(UnsafeCheckpointError, match="outside the safe allowlist"):
        safe_load(path)


def test_safe_load_reads_plain_and_mmengine_like_checkpoints(tmp_path):
    import numpy as np

    path = str(tmp_path / "ok.pth")
    torch.save({"state_dict": {"w": torch.ones(2)}, "meta": {"iter": 4}, "hub": np.array([1.0, 2.0])}, path)
    with pytest.raises(UnsafeCheckpointError):  # the core allows no runner's types by itself
        safe_load(path)
    ckpt = load_mmengine_checkpoint(path)  # the MMEngine adapter's list (numpy arrays in the message hub)
    assert ckpt["meta"]["iter"] == 4 and ckpt["hub"].tolist() == [1.0, 2.0]


@pytest.mark.skipif(not HAS_SAFE_GLOBALS, reason="torch < 2.5 has no safe_globals context")
def test_safe_load_allowlist_is_scoped_to_the_call(tmp_path):
    from torch.serialization import get_safe_globals

    before = set(map(repr, get_safe_globals()))
    path = str(tmp_path / "ok.pth")
    torch.save({"w": torch.ones(1)}, path)
    safe_load(path)
    assert set(map(repr, get_safe_globals())) == before


def test_safe_load_truncated_file_raises(tmp_path):
    path = str(tmp_path / "trunc.pth")
    torch.save({"w": torch.ones(1000)}, path)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises((RuntimeError, EOFError, pickle.UnpicklingError, UnsafeCheckpointError)):
        safe_load(path)


def test_faults_fire_once_per_planned_iteration_and_rank():
    f = Fault("weights", iters=[3], ranks=[1])
    assert not f.hits(1, 1) and not f.hits(2, 0)
    assert f.hits(2, 1)
    assert not f.hits(2, 1)  # the counter comes round again after a rollback: no second shot


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(kind="cosmic-ray", iters=[1]), "unknown fault kind 'cosmic-ray'"),
        (dict(kind="loss", iters=[0]), "got [0]"),
        (dict(kind="loss", iters=[]), "got []"),
        (dict(kind="loss", iters=[2], value="lots"), "could not convert"),
    ],
)
def test_bad_faults(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_faults([kwargs])


def test_fault_planting_functions():
    m = nn.Linear(2, 2)
    assert poison_weights(m) == "weight" and math.isnan(m.weight[0, 0].item())
    m = nn.Linear(2, 2)
    arm_grad_fault(m, math.inf, "bias")
    m(torch.ones(1, 2)).sum().backward()
    assert math.isinf(m.bias.grad[0].item())
    m.zero_grad()
    m(torch.ones(1, 2)).sum().backward()
    assert torch.isfinite(m.bias.grad).all()  # the hook fired once
    out = poison_loss({"loss_cls": torch.ones(()), "acc": torch.ones(())}, math.nan)
    assert math.isnan(out["loss_cls"].item()) and out["acc"].item() == 1.0
    batch = {"inputs": torch.ones(2), "labels": torch.ones(2, dtype=torch.long)}
    assert poison_batch(batch, 1e6) == 1 and batch["inputs"][0].item() == 1e6


def _trained_adam():
    m = nn.Linear(3, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    for _ in range(2):
        m(torch.randn(2, 3)).sum().backward()
        opt.step()
    return m, opt


def test_load_optimizer_state_copies_in_place_and_never_aliases_the_snapshot():
    from petr_stability.core.recovery.snapshot import load_optimizer_state

    m, opt = _trained_adam()
    saved = copy_to_host(opt.state_dict())
    frozen = copy.deepcopy(saved)
    buffers = [id(t) for st in opt.state.values() for t in st.values()]
    opt.param_groups[0]["lr"] = 123.0
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    load_optimizer_state(opt, saved)
    assert [id(t) for st in opt.state.values() for t in st.values()] == buffers  # same buffers, no allocation
    assert opt.param_groups[0]["lr"] == 0.1  # hyper-parameters come back too (schedulers write them)
    for _ in range(2):  # later steps must not write into the snapshot
        m(torch.randn(2, 3)).sum().backward()
        opt.step()
    for a, b in zip(iter_tensors(saved["state"]), iter_tensors(frozen["state"])):
        assert torch.equal(a, b)


def test_load_optimizer_state_falls_back_when_layout_differs():
    from petr_stability.core.recovery.snapshot import load_optimizer_state

    m, opt = _trained_adam()
    saved = copy_to_host(opt.state_dict())
    fresh = torch.optim.AdamW(m.parameters(), lr=0.1)  # no state yet: nothing to copy into
    load_optimizer_state(fresh, saved)
    st = next(iter(fresh.state.values()))
    assert torch.equal(st["exp_avg"], next(iter(saved["state"].values()))["exp_avg"])
    assert st["exp_avg"] is not next(iter(saved["state"].values()))["exp_avg"]


def test_snapshot_buffers_fall_back_to_pageable_memory_when_pinning_fails(monkeypatch):
    # Page-locked memory can run out (a large model's ring on every rank of a node): the snapshot must still
    # be taken, in ordinary memory with a synchronous copy, with one clear warning, not fail the training run.
    from petr_stability.core.recovery import snapshot

    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(snapshot, "_PIN_FAILED", False)
    with pytest.warns(RuntimeWarning, match="pinned host memory unavailable .*cudaHostAlloc"):
        buf, pinned = snapshot._host_buffer(torch.ones(2, 3, dtype=torch.float16), pin=True)
    assert not pinned and buf.shape == (2, 3) and buf.dtype == torch.float16 and buf.device.type == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next buffers go to pageable memory without a word
        buf, pinned = snapshot._host_buffer(torch.ones(4), pin=True)
    assert not pinned and buf.shape == (4,)
