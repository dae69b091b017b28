"""Issue 41: data-parallel replicas that drift apart. The digest and the comparison in one process; the check issued,
read, repaired and left off over two real gloo ranks (the torch loop and both runner families end to end are in
tests/distributed/)."""
import math
import os
import sys

import pytest
import torch
from torch import nn

from petr_stability.core.config import GuardConfig
from petr_stability.core.watch import replicas as replicas_module
from petr_stability.core.watch.replicas import (
    Mismatch,
    ReplicaCheck,
    compare,
    digests,
    replicated_tensors,
    tensor_digest,
    unreplicated,
)

COMMON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed", "common")


# ------------------------------------------------------------------ the digest
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                   torch.int8, torch.bool, torch.complex64])
def test_the_digest_is_the_same_for_the_same_bits_and_differs_for_one_changed_element(dtype):
    t = (torch.randn(5, 7) * 10).to(dtype) if dtype != torch.complex64 else torch.randn(5, 7, dtype=dtype)
    assert torch.equal(tensor_digest(t), tensor_digest(t.clone()))
    changed = t.clone()
    if dtype == torch.bool:
        changed.view(-1)[3] = not bool(changed.view(-1)[3])
    else:
        changed.view(-1)[3] += 1
    assert not torch.equal(tensor_digest(t), tensor_digest(changed))


def test_a_drift_of_1e_3_an_exchange_of_two_values_and_a_signed_zero_are_seen():
    t = torch.randn(1000)
    drifted, swapped, zero = t.clone(), t.clone(), torch.zeros(4)
    drifted[17] += 1e-3
    swapped[[3, 4]] = swapped[[4, 3]]
    assert not torch.equal(tensor_digest(t), tensor_digest(drifted))
    assert not torch.equal(tensor_digest(t), tensor_digest(swapped))  # the sum of the bits alone would not see it
    assert not torch.equal(tensor_digest(zero), tensor_digest(-zero))  # bit for bit: -0.0 is not 0.0


def test_the_digest_of_a_large_tensor_in_chunks_is_its_digest_in_one_piece(monkeypatch):
    t, view = torch.randn(101), torch.randn(10, 12).t()  # and a non-contiguous view
    whole = tensor_digest(t)
    monkeypatch.setattr(replicas_module, "_CHUNK", 8)  # the pairs that straddle two chunks count once
    assert torch.equal(tensor_digest(t), whole)
    assert torch.equal(tensor_digest(view), tensor_digest(view.contiguous()))
    assert tensor_digest(torch.zeros(0)).tolist() == [0, 0] and tensor_digest(torch.tensor(2.0)).shape == (2,)


def test_the_asynchronous_gather_takes_host_tensors_and_without_a_group_gives_back_this_rank_s():
    from petr_stability.core import distributed

    t = torch.arange(4)
    assert [x.tolist() for x in distributed.gather_tensor_async(t).wait()] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="gathers CPU tensors over the gloo host group, got one on meta"):
        distributed.gather_tensor_async(torch.zeros(2, device="meta"))


def test_digests_are_one_host_tensor_of_two_int64_per_tensor():
    rows = digests([torch.randn(3), torch.ones(2, 2, dtype=torch.float16)])
    assert rows.shape == (2, 2) and rows.dtype == torch.int64 and rows.device.type == "cpu"
    assert digests([]).shape == (0, 2)


# ------------------------------------------------------------------ what is compared, and where it stays off
class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.norm = nn.BatchNorm1d(2)
        self.register_buffer("table", torch.arange(4.0))
        self.register_buffer("mask", torch.ones(2), persistent=False)


def test_every_parameter_and_every_buffer_but_normalization_statistics_is_compared():
    names = [n for n, _ in replicated_tensors(WithBuffers())]
    assert names == ["fc.weight", "fc.bias", "norm.weight", "norm.bias", "table", "mask"]


def test_sharded_parameters_are_named_as_the_reason_the_check_stays_off():
    assert unreplicated(WithBuffers()) is None
    model = WithBuffers()
    model.fc.weight = type("DTensor", (nn.Parameter,), {})(model.fc.weight.detach())
    assert unreplicated(model) == "parameter fc.weight is a DTensor (sharded by FSDP or a tensor-parallel plan)"
    model = WithBuffers()
    model.fc.bias.ds_id = 7
    assert unreplicated(model) == "parameter fc.bias is partitioned by DeepSpeed ZeRO"
    wrapped = type("FullyShardedDataParallel", (nn.Module,), {})()
    wrapped.inner = nn.Linear(1, 1, bias=False)
    assert unreplicated(wrapped) == "module (the model) is sharded by FSDP (FullyShardedDataParallel)"


# ------------------------------------------------------------------ the comparison
def rows(*values):
    return torch.tensor([[v, 0] for v in values], dtype=torch.int64)


def test_the_same_copy_everywhere_is_no_mismatch():
    assert compare([rows(1, 2), rows(1, 2)]) is None and compare([rows(1, 2)]) is None


def test_two_ranks_that_differ_take_rank_0_s_copy():
    assert compare([rows(1, 2, 3), rows(1, 9, 3)]) == Mismatch(0, (1,), (1,))


def test_the_copy_most_ranks_hold_is_the_reference_whichever_rank_drifted():
    assert compare([rows(5, 2), rows(1, 2), rows(1, 2)]) == Mismatch(1, (0,), (0,))
    assert compare([rows(1, 2), rows(1, 2), rows(1, 7), rows(4, 2)]) == Mismatch(0, (2, 3), (0, 1))
    # As many ranks on each side: the lowest rank's copy.
    assert compare([rows(1), rows(2), rows(2), rows(1)]) == Mismatch(0, (1, 2), (0,))


# ------------------------------------------------------------------ the guard without a process group
def test_a_run_without_a_process_group_never_calls_into_the_replica_check(tmp_path):
    # Issue 41: the check must cost a single-process run nothing (and stay off the measured divergence path).
    from test_incident_schema import nan_weights, run

    called = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == replicas_module.__file__:
            called.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        io = run(str(tmp_path), 8, {6: nan_weights}, replica_check_interval=1)
    finally:
        sys.setprofile(None)
    assert called == ["__init__"] and io.iter == 8  # built with the guard (its counters), never called after


def test_the_check_s_counters_ride_in_the_guard_s_state_and_load_back(tmp_path):
    from fake_io import FakeIO, make_guard

    guard = make_guard(FakeIO(str(tmp_path)))
    counts = {"checks": 7, "drifts": 2, "repairs": 1, "last_clean": 40,
              "history": [{"check": 3, "iteration": 12, "ranks": [1]}, {"check": 7, "iteration": 28, "ranks": [1]}]}
    guard.replicas.counts = dict(counts)
    state = guard.state_dict()
    assert state["replicas"] == counts
    other = make_guard(FakeIO(str(tmp_path)))
    other.load_state_dict(state)
    assert other.replicas.counts == counts and other.state_dict()["replicas"] == counts
    other.load_state_dict({})  # an older checkpoint without them
    assert other.replicas.counts == {"checks": 0, "drifts": 0, "repairs": 0, "last_clean": 0, "history": []}


def test_the_interval_is_a_setting_checked_as_the_hook_is_built():
    assert GuardConfig().replica_check_interval == 100 and GuardConfig(replica_check_interval=0)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=f"replica_check_interval must be an integer >= 0, got {bad!r}"):
            GuardConfig(replica_check_interval=bad)


def test_issuing_twice_without_reading_is_refused(tmp_path, monkeypatch):
    check = ReplicaCheck(1)
    io = type("IO", (), {"model": lambda self: nn.Linear(1, 1)})()
    check.issue(io, replicas_module.StepSignals(1), 0, 0)  # without a group: its own digests, nothing in flight
    with pytest.raises(RuntimeError, match="still in flight"):
        check.issue(io, replicas_module.StepSignals(2), 0, 0)
    outcome = check.conclude(io, 2, 0)
    assert outcome.records == [] and check.pending is None and check.counts["last_clean"] == 1


# ------------------------------------------------------------------ over two real ranks
def test_over_two_ranks_a_drift_is_repaired_a_nan_is_left_and_the_check_stays_off_where_it_cannot_tell(tmp_path):
    sys.path.insert(0, COMMON)
    try:
        from launch import run_workers
    finally:
        sys.path.remove(COMMON)
    (r0, r1), _ = run_workers(os.path.join(COMMON, "replica_worker.py"), "all", str(tmp_path), timeout=120)
    assert r0["on"] and r1["on"]
    assert r0["clean"] == r1["clean"] == {"records": [], "repaired": False, "clean_since": 4, "error": None}
    # The drift: rank 1's weight (and one optimizer moment) take rank 0's, bit for bit; the record names it.
    assert r0["drift"]["repaired"] and r1["drift"]["repaired"] and r0["drift"]["records"] == r1["drift"]["records"]
    assert r1["before"] != r0["before"] and r1["after"] == r0["after"] == r0["before"]
    (rec,) = r0["drift"]["records"]
    assert (rec["event"], rec["iteration"], rec["acted_at"], rec["drifted_ranks"], rec["reference_rank"]) == (
        "replica_drift", 8, 9, [1], 0)
    (row,) = rec["tensors"]
    assert (row["name"], row["rank"], row["elements"]) == ("0.weight", 1, 1)
    assert math.isclose(row["max_abs_diff"], 1e-3, rel_tol=1e-3)
    assert rec["reason"].startswith("replicas differ: rank(s) 1 hold a copy unlike rank 0's in 1 tensor(s)")
    assert rec["verdict"] == "HEALTHY" and rec["restored_from"] is None and rec["iterations_lost"] == 0
    # A NaN on the reference rank is not copied to the others: the divergence path's.
    # (Every copy is known the same since the repair, read at iteration 9.)
    assert r0["nan"] == r1["nan"] == {"records": [], "repaired": False, "clean_since": 9, "error": None}
    assert r0["nan_left"]
    # A rollback between the issue and the read: the state it described is gone; nothing counted.
    assert r0["outlived"]["records"] == [] and r0["counts"]["checks"] == r1["counts"]["checks"] == 3
    assert r0["counts"] == r1["counts"] and r0["counts"]["drifts"] == r0["counts"]["repairs"] == 1
    for r in (r0, r1):
        assert r["off_structure"][0] is False and "the ranks hold different tensors" in r["off_structure"][1][0]
        assert r["off_weights"][0] is False and "the ranks start from different weights" in r["off_weights"][1][0]
        assert r["off_sharded"] == [False, ["[warning] NanGuard: the replica check is off: rank 1: parameter "
                                            "0.weight is a DTensor (sharded by FSDP or a tensor-parallel plan): which "
                                            "ranks hold the same shard is not the guard's to tell"]]
