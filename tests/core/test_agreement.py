"""The per-step agreement off the critical path (issue 35): the asynchronous MAX primitive, StepAgreement, and the guard
acting on a step's verdict one iteration later under a process group (here a one-rank gloo group in this process: the
same code path as N ranks), and at once without one."""
import math
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from fake_io import FakeIO, make_guard, run

from petr_stability.adapters.driver import GuardDriver
from petr_stability.core import distributed
from petr_stability.core.config import GuardConfig
from petr_stability.core.records import read_incidents
from petr_stability.core.watch.agreement import StepAgreement
from petr_stability.core.watch.detector import Verdict


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank in this process, torn down after the test (the guard caches its groups)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        distributed._GROUP = None
        distributed._NODE = None


# ------------------------------------------------------------------ the primitive
def test_without_a_group_the_values_come_back_as_they_are():
    pending = distributed.reduce_max_async([3, 1])
    assert pending.wait() == [3, 1] and pending.wait() == [3, 1]


def test_an_async_max_can_wait_while_other_collectives_run(one_rank_group):
    pending = distributed.reduce_max_async([2, 7])
    assert distributed.reduce_max([5]) == [5]  # another collective on the same group in between
    assert distributed.gather("x") == ["x"]
    assert pending.wait() == [2, 7] and pending.wait() == [2, 7]


def test_an_async_max_reduces_into_the_buffer_it_is_given(one_rank_group):
    buffer = torch.zeros(2, dtype=torch.int64)
    assert distributed.reduce_max_async([4, 9], buffer).wait() == [4, 9]
    assert buffer.tolist() == [4, 9]
    with pytest.raises(ValueError, match="int64 CPU tensor of 2 elements"):
        distributed.reduce_max_async([1, 2], torch.zeros(2))


def test_step_agreement_without_a_group_agrees_at_once():
    agreement = StepAgreement()
    assert not agreement.defers()
    assert agreement.now(Verdict.OVERFLOW) == Verdict.OVERFLOW
    assert (agreement.blocking, agreement.deferred) == (0, 0)


def test_step_agreement_carries_one_step_at_a_time(one_rank_group):
    agreement = StepAgreement()
    assert agreement.defers() and not agreement.pending
    agreement.submit(Verdict.STALLED, {"iteration": 7})
    assert agreement.pending
    with pytest.raises(RuntimeError, match="still being agreed"):
        agreement.submit(Verdict.HEALTHY, {"iteration": 8})
    assert agreement.take() == (Verdict.STALLED, {"iteration": 7})
    with pytest.raises(RuntimeError, match="no step's verdict"):
        agreement.take()
    assert agreement.now(Verdict.DIVERGED) == Verdict.DIVERGED
    assert (agreement.deferred, agreement.blocking) == (1, 1)


# ------------------------------------------------------------------ the guard under a process group
def test_healthy_steps_wait_for_no_rank_and_their_snapshots_enter_the_ring_once_agreed(tmp_path, one_rank_group):
    io = FakeIO(str(tmp_path))
    guard = make_guard(io)  # snapshot_interval=5, keep_snapshots=3
    verdicts = run(io, guard, 20)
    assert {v for _, v in verdicts} == {"HEALTHY"}
    # Agreed at once: iteration 1 only (no snapshot exists yet: the first one is taken with its verdict); every other
    # step one iteration later, snapshot steps included; the last (20) is still on its way.
    assert (guard.agreement.blocking, guard.agreement.deferred) == (1, 19)
    assert guard.agreement.pending and guard.batches.held is not None
    # Iteration 20's snapshot is taken (into the buffers of the oldest, 5, which left the ring) but not in the ring
    # before its verdict.
    assert [s.iteration for s in guard.points.ring.snapshots] == [10, 15]
    assert not guard.settle(inside=False) and not guard.agreement.pending
    assert [s.iteration for s in guard.points.ring.snapshots] == [10, 15, 20]
    assert [s.clean_steps for s in guard.points.ring.snapshots] == [10, 5, 0]  # as without a process group


def test_a_snapshot_of_a_step_that_diverged_never_becomes_a_restore_point(tmp_path, one_rank_group):
    io = FakeIO(str(tmp_path), mode="none", skip=False)
    # confirm_steps=0: a snapshot counts as healthy at once, so a snapshot of iteration 15 in the ring would come first.
    guard = make_guard(io, skip_nonfinite_fp32=False, confirm_steps=0)
    run(io, guard, 25, faults={14: "grad"})  # iteration 15, a snapshot step, applies a non-finite gradient
    # Its snapshot was taken at iteration 15 (into the buffers of iteration 1's, which left the ring), then discarded
    # with the agreed verdict: the rollback goes to the newest snapshot before it.
    assert io.restores == [10]
    (rec,) = read_incidents(str(tmp_path))
    assert (rec["iteration"], rec["acted_at"], rec["restored_from"]["iteration"], rec["iterations_lost"]) == (
        15, 16, 10, 6)


def test_a_single_process_acts_at_once_and_sends_nothing(tmp_path):
    io = FakeIO(str(tmp_path), mode="none", skip=False)
    guard = make_guard(io, skip_nonfinite_fp32=False)
    run(io, guard, 25, faults={12: "grad"})
    (rec,) = read_incidents(str(tmp_path))
    assert rec["iteration"] == 13 and "acted_at" not in rec and rec["iterations_lost"] == 13 - 5
    assert (guard.agreement.blocking, guard.agreement.deferred) == (0, 0)


def test_a_divergence_is_acted_on_one_iteration_later_with_its_own_numbers(tmp_path, one_rank_group):
    io = FakeIO(str(tmp_path), mode="none", skip=False)
    guard = make_guard(io, skip_nonfinite_fp32=False)
    verdicts = run(io, guard, 25, faults={12: "grad"})  # iteration 13 applies a non-finite gradient
    # Iteration 14 (0-based 13) acts on iteration 13's verdict: it trained on the path it abandons.
    assert verdicts[:14] == [(i, "HEALTHY") for i in range(13)] + [(13, "DIVERGED")]
    assert io.restores == [5]  # the newest confirmed snapshot, as without a process group
    assert all(bool(torch.isfinite(p).all()) for p in io.net.parameters())
    assert io.clip["max_norm"] == 1.0 and io.net.layer.dropout.p == 0.0
    (rec,) = read_incidents(str(tmp_path))
    assert rec["event"] == "divergence" and rec["iteration"] == 13 and rec["signals"]["iteration"] == 13
    assert rec["acted_at"] == 14 and rec["iterations_lost"] == 14 - 5
    assert rec["restored_from"] == {"source": "memory", "iteration": 5} and rec["world_size"] == 1
    assert guard.chain.iterations_lost == 9


def test_a_skipped_step_is_recorded_under_its_own_iteration(tmp_path, one_rank_group):
    io = FakeIO(str(tmp_path), mode="none", skip=True)
    guard = make_guard(io)
    run(io, guard, 20, faults={10: "grad"})
    (rec,) = read_incidents(str(tmp_path))
    assert rec["event"] == "skip" and rec["iteration"] == 11 and rec["signals"]["step_applied"] is False
    assert guard.skipped_steps == guard.fp32_skips == 1 and io.restores == []


class BatchIO(FakeIO):
    """FakeIO whose batches are named: each iteration trains on its own batch, and a replay says which it re-ran."""

    def __init__(self, work_dir: str) -> None:
        super().__init__(work_dir, mode="none", skip=False)
        self.replayed: List[int] = []

    def rerun_forward(self, batch: Any):
        def forward() -> Dict[str, torch.Tensor]:
            self.replayed.append(batch["n"])
            return {"loss": self.net(batch["x"])}

        return forward


def test_the_incident_replays_its_own_batch_and_the_batch_before_it_as_the_good_one(tmp_path, one_rank_group):
    io = BatchIO(str(tmp_path))
    guard = make_guard(io, skip_nonfinite_fp32=False)
    while io.iter < 16:
        n = io.iter + 1
        x = torch.randn(4, 2, 8)
        if n == 13 and not io.restores:
            x[0, 0, 0] = math.nan  # a bad sample: it breaks the healthy weights too, so the good batch is re-run
        batch = {"n": n, "x": x}
        guard.begin(batch, None)
        loss = io.net(batch["x"])
        io.opt.zero_grad()
        loss.backward()
        io.probe(io.net.parameters(), **io.clip)
        io.opt.step()
        io.last_loss = float(loss)
        guard.after_iter()
        io.iter += 1
    # The failing batch is iteration 13's (not 14's, in hand when the verdict came); the batch known to be good is
    # iteration 12's: the newest whose agreed verdict was healthy.
    assert io.replayed[0] == 13 and 12 in io.replayed and 14 not in io.replayed
    rec = next(r for r in read_incidents(str(tmp_path)) if r["event"] == "divergence")
    assert rec["iteration"] == 13 and rec["acted_at"] == 14
    assert rec["diagnosis"]["good_batch"]["batch"] == "the batch of iter 12"


def test_the_driver_acts_on_the_last_verdict_at_the_epoch_end(tmp_path, one_rank_group):
    io = FakeIO(str(tmp_path), mode="none", skip=False)
    driver = GuardDriver(GuardConfig(snapshot_interval=5, confirm_steps=3, check_interval=4, skip_nonfinite_fp32=False,
                                     write_patched_config=False))
    driver.bind(io)
    driver.start()
    while io.iter < 14:
        io.train_step(poison_grad=io.iter == 13)  # the last iteration (14) diverges
        driver.after_iter()
        io.iter += 1
    assert io.restores == [] and driver.guard.agreement.pending
    driver.after_epoch()  # no iteration follows: its verdict is acted on here
    assert io.restores == [10] and not driver.guard.agreement.pending  # confirmed by iterations 11-13
    (rec,) = read_incidents(str(tmp_path))
    assert rec["iteration"] == 14 and "acted_at" not in rec and rec["iterations_lost"] == 14 - 10
    assert io.iter == 10  # the counter after the epoch's end: 10 iterations completed
