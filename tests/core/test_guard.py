"""The core guard end to end over a plain torch loop (FakeIO): verdicts, remedies, rollback, budget, state."""
import json
import math
import re

import pytest
import torch
from fake_io import FakeIO, make_guard, run

from petr_stability.core.config import GuardConfig
from petr_stability.core.errors import NanGuardGaveUp, NoHealthyStateError, UnsafeCheckpointError
from petr_stability.core.records import read_incidents
from petr_stability.core.recovery.restore import check_checkpoint


def first(verdicts):
    """Verdict of each iteration the first time it ran (a rollback runs some numbers again)."""
    out = {}
    for i, v in verdicts:
        out.setdefault(i, v)
    return out


def finite(io):
    return all(bool(torch.isfinite(p).all()) for p in io.net.parameters())


def test_healthy_run_changes_nothing(tmp_path):
    io = FakeIO(str(tmp_path))
    guard = make_guard(io)
    verdicts = run(io, guard, 20)
    assert {v for _, v in verdicts} == {"HEALTHY"}
    assert io.clip["max_norm"] == 35.0 and io.net.layer.dropout.p == 0.1
    assert io.restores == [] and read_incidents(str(tmp_path)) == []
    assert io.scalars["nan_guard/max_norm"] == 35.0


def test_harmless_overflow_under_scaler_changes_nothing(tmp_path):
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io)
    verdicts = run(io, guard, 20, faults={10: "grad"})
    assert first(verdicts)[10] == "OVERFLOW"
    assert io.clip["max_norm"] == 35.0 and io.net.layer.dropout.p == 0.1 and io.restores == []
    assert guard.skipped_steps == 1 and read_incidents(str(tmp_path)) == []
    assert any("harmless overflow" in m for _, m in io.logs)


def test_an_overflow_under_a_static_scale_is_a_step_lost_not_called_harmless(tmp_path):
    io = FakeIO(str(tmp_path), mode="static")
    guard = make_guard(io)
    verdicts = run(io, guard, 20, faults={10: "grad"})
    assert first(verdicts)[10] == "OVERFLOW" and io.restores == [] and guard.skipped_steps == 1
    (line,) = [m for _, m in io.logs if "iter 11" in m or "iter 10" in m]
    assert "gradient overflow under a static scale" in line and "harmless" not in line


def test_fp32_transient_nan_step_is_skipped_not_applied(tmp_path):
    io = FakeIO(str(tmp_path), mode="none", skip=True)
    guard = make_guard(io)
    verdicts = run(io, guard, 20, faults={10: "grad"})
    assert first(verdicts)[10] == "OVERFLOW" and finite(io) and io.restores == []


def test_fp32_skip_is_an_event_in_the_incident_log_and_not_an_overflow(tmp_path):
    io = FakeIO(str(tmp_path), mode="none", skip=True)
    guard = make_guard(io)
    run(io, guard, 20, faults={10: "grad"})
    (rec,) = read_incidents(str(tmp_path))
    assert rec["event"] == "skip" and rec["iteration"] == 11 and rec["verdict"] == "OVERFLOW"
    assert rec["signals"]["step_applied"] is False and "fp32 step skipped: non-finite gradient" in rec["reason"]
    assert guard.skipped_steps == guard.fp32_skips == 1 and io.scalars["nan_guard/skipped_steps"] == 1.0
    logged = [m for _, m in io.logs if "iter 11" in m]
    assert logged and "fp32 step skipped before the optimizer applied it" in logged[0]
    assert not any("harmless overflow" in m for _, m in io.logs)


def test_fp32_nan_step_applied_without_skip_rolls_back(tmp_path):
    io = FakeIO(str(tmp_path), mode="none", skip=False)
    guard = make_guard(io, skip_nonfinite_fp32=False)
    verdicts = run(io, guard, 25, faults={12: "grad"})
    assert first(verdicts)[12] == "DIVERGED"
    assert io.restores == [5]  # newest confirmed snapshot: the state after iter 5 (interval 5), 3 clean steps after
    assert finite(io) and io.clip["max_norm"] == 1.0 and io.net.layer.dropout.p == 0.0
    assert io.net.layer.self_attn.dropout == 0.0
    (rec,) = read_incidents(str(tmp_path))
    assert rec["event"] == "divergence" and rec["iteration"] == 13 and rec["signals"]["iteration"] == 13
    assert rec["iterations_lost"] == 13 - 5
    assert rec["restored_from"] == {"source": "memory", "iteration": 5}
    assert {"target": "clip.max_norm", "old": 35.0, "new": 1.0} in rec["actions"]


def test_poisoned_weights_recover_and_finish(tmp_path):
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io)
    verdicts = run(io, guard, 30, faults={17: "weights"})
    assert first(verdicts)[17] == "DIVERGED"
    assert finite(io) and io.iter == 30 and guard.recoveries == 1
    # The state after 15 had only 2 clean steps when iteration 18 diverged: not confirmed, so 10 is used.
    assert io.restores == [10]


def test_early_divergence_recovers_from_an_unconfirmed_snapshot_then_the_start_state(tmp_path):
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io, confirm_steps=10)  # nothing is confirmed before iteration 11
    run(io, guard, 20, faults={3: "weights"})
    assert io.restores == [1] and finite(io) and io.iter == 20  # the first healthy step's snapshot
    assert any("no confirmed snapshot is left; using memory (unconfirmed) state of iter 1" in m for _, m in io.logs)
    io2 = FakeIO(str(tmp_path / "b"), mode="dynamic")
    guard2 = make_guard(io2, confirm_steps=10)
    run(io2, guard2, 4, faults={3: "weights"})
    run(io2, guard2, 6, faults={4: "weights"})  # diverges again, nothing confirmed since: the start state
    assert io2.restores == [1, 0] and finite(io2)


def test_no_restore_point_left_gives_clear_error_listing_what_was_tried(tmp_path):
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io, confirm_steps=10, max_recoveries=10)
    run(io, guard, 2)  # the first healthy step's snapshot (iter 1), unconfirmed
    with pytest.raises(NoHealthyStateError) as err:
        for _ in range(4):  # every state diverges on the very next iteration after it is restored
            with torch.no_grad():
                io.net.out.weight[0, 0] = math.nan
            io.train_step()
            guard.after_iter()
            io.iter += 1
    msg = str(err.value)
    assert "no healthy state of this run is left to roll back to" in msg
    # Both points diverged on the very next iteration: the start state is not tried a third time.
    assert "start state (iter 0)" in msg and "snapshot of iter 1" in msg
    assert [r["restored_from"]["source"] for r in read_incidents(str(tmp_path))[:2]] == ["memory", "start"]
    assert "clip.max_norm 35.0 -> 1.0" in msg  # the remedies already applied are listed
    assert [r["event"] for r in read_incidents(str(tmp_path))][-1] == "gave_up"


def test_falls_back_to_this_runs_newest_finite_checkpoint_skipping_bad_and_foreign_files(tmp_path):
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io, confirm_steps=50, snapshot_interval=1000)
    good = {"state_dict": {k: v.clone() for k, v in io.net.state_dict().items()}, "optimizer": io.opt.state_dict()}
    poisoned = {"state_dict": {k: v.clone() * math.nan for k, v in io.net.state_dict().items()},
                "optimizer": io.opt.state_dict()}
    mine = {"run_id": guard.run_id}
    io.ckpts = ["truncated.pth", "poisoned.pth", "good.pth", "other_run.pth", "later.pth"]
    io.loaded = {"poisoned.pth": (poisoned, 3, mine), "good.pth": (good, 2, mine),
                 "other_run.pth": (good, 4, {"run_id": "another"}), "later.pth": (good, 40, mine)}
    guard.points.start = None  # only checkpoints are left once the in-memory points are spent
    run(io, guard, 12, faults={6: "weights"})  # back to the first healthy step's (unconfirmed) snapshot
    run(io, guard, 14, faults={12: "weights"})  # diverges again: only checkpoints are left
    assert io.restores == [1, 2] and finite(io)
    msgs = " ".join(m for _, m in io.logs)
    assert "skipping checkpoint truncated.pth" in msgs and "skipping checkpoint poisoned.pth" in msgs
    assert "ignoring 2 checkpoint(s) not written by this run" in msgs
    assert "other_run.pth (iter 4)" in msgs and "later.pth (iter 40)" in msgs
    assert read_incidents(str(tmp_path))[1]["restored_from"] == {"source": "good.pth", "iteration": 2}


def test_recurring_divergence_steps_back_to_an_older_snapshot(tmp_path):
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io, keep_snapshots=3, snapshot_interval=5, confirm_steps=1)
    # Iteration 13 diverges -> back to the state after 10. Iteration 15 diverges again, before any newer snapshot
    # is confirmed -> the state after 10 was tried in this incident chain -> step back to 5.
    run(io, guard, 13, faults={12: "weights"})
    run(io, guard, 20, faults={14: "weights"})
    assert io.restores[:2] == [10, 5]


def test_endless_divergence_stops_with_budget_error_naming_log(tmp_path):
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io, max_recoveries=2, confirm_steps=1, keep_snapshots=2)
    with pytest.raises(NanGuardGaveUp) as err:
        for _ in range(20):
            run(io, guard, io.iter + 8, faults={io.iter + 6: "weights"})
    msg = str(err.value)
    assert "recovery budget is spent (2 of max_recoveries=2)" in msg
    assert str(tmp_path / "nan_guard_incidents.jsonl") in msg and "clip.max_norm 35.0 -> 1.0" in msg
    assert [r["event"] for r in read_incidents(str(tmp_path))] == ["divergence", "divergence", "gave_up"]


def test_max_norm_schedule_tightens_per_incident(tmp_path):
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io, max_norm_schedule=[10.0, 3.0, 1.0], confirm_steps=1)
    seen = []
    for _ in range(4):
        run(io, guard, io.iter + 8, faults={io.iter + 6: "weights"})
        seen.append(io.clip["max_norm"])
    assert seen == [10.0, 3.0, 1.0, 1.0]


def test_state_round_trip_reapplies_remedies_on_resume(tmp_path):
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io)
    run(io, guard, 20, faults={12: "weights"})
    state = guard.state_dict()
    fresh = FakeIO(str(tmp_path), mode="dynamic")
    g2 = make_guard(fresh)
    g2.load_state_dict(json.loads(json.dumps(state)))  # survives serialization
    g2.setup()
    assert fresh.clip["max_norm"] == 1.0 and fresh.net.layer.dropout.p == 0.0
    assert g2.state_dict() == state
    g2.load_state_dict({})  # an old checkpoint without the guard's keys loads
    assert g2.recoveries == 0


def test_static_stall_without_scale_remedy_escalates_to_rollback(tmp_path):
    io = FakeIO(str(tmp_path), mode="static")
    guard = make_guard(io, static_patience=2, confirm_steps=1)
    run(io, guard, 10)
    for _ in range(2):
        io.train_step(poison_grad=True)
        guard.after_iter()
        io.iter += 1
    assert guard.recoveries == 1  # FakeIO offers no make_scale_dynamic
    assert "no scale remedy available" in read_incidents(str(tmp_path))[0]["reason"]


def test_check_checkpoint_refuses_nonfinite(tmp_path):
    io = FakeIO(str(tmp_path))
    sd = {k: v.clone() for k, v in io.net.state_dict().items()}
    check_checkpoint({"state_dict": sd}, "x.pth")
    sd["out.bias"][0] = math.inf
    with pytest.raises(UnsafeCheckpointError, match=r"x\.pth holds non-finite values \(first: out\.bias\)"):
        check_checkpoint({"state_dict": sd}, "x.pth")


@pytest.mark.parametrize(
    "kwargs, err, needle",
    [
        (dict(check_interval=0), ValueError, "check_interval must be an integer >= 1, got 0"),
        (dict(snapshot_interval=-5), ValueError, "snapshot_interval must be an integer >= 1, got -5"),
        (dict(keep_snapshots=1), ValueError, "keep_snapshots must be an integer >= 2, got 1"),
        (dict(max_recoveries=-1), ValueError, "max_recoveries must be an integer >= 0, got -1"),
        (dict(max_norm=0), ValueError, "max_norm must be a number > 0, got 0"),
        (dict(max_norm=-1.0), ValueError, "got -1.0"),
        (dict(max_norm_schedule=[10, math.inf]), ValueError, "got inf"),
        (dict(max_norm_schedule=[]), ValueError, "max_norm_schedule must not be empty"),
        (dict(remedies=["clip", "pray"]), ValueError, "remedies: unknown entry 'pray'"),
        (dict(remedies="clip"), TypeError, "remedies must be a list of strings, got 'clip'"),
        (dict(remedies=None), TypeError, "remedies must be a list of strings, got None"),
        (dict(dropout_scope="heads"), ValueError, "dropout_scope must be one of ['transformer', 'all'], got 'heads'"),
        (dict(dropout_exclude=None), TypeError, "dropout_exclude must be a list of strings, got None"),
        (dict(dropout_exclude="backbone"), TypeError, "dropout_exclude must be a list of strings, got 'backbone'"),
        (dict(dropout_exclude=[1, 2]), TypeError, "got the element 1 in [1, 2]"),
        (dict(max_norm_schedule=5.0), TypeError, "max_norm_schedule must be a list, got 5.0"),
        (dict(diagnose="yes"), TypeError, "diagnose must be a bool, got 'yes'"),
        (dict(snapshot_copies="gpu"), ValueError, "snapshot_copies must be one of ['rank', 'node'], got 'gpu'"),
        (dict(patience=0), ValueError, "patience must be an integer >= 1, got 0"),
        (dict(confirm_steps=1.5), ValueError, "confirm_steps must be an integer >= 0, got 1.5"),
    ],
)
def test_bad_config_names_argument_and_value(kwargs, err, needle):
    with pytest.raises(err, match=re.escape(needle)):
        GuardConfig(**kwargs)


def test_loss_scale_is_published_on_check_iterations_only(tmp_path):
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io, check_interval=4, snapshot_interval=1000)
    run(io, guard, 2)  # iteration 0: first snapshot (a check); iteration 1: no check
    io.scalars.clear()
    run(io, guard, 3)  # iteration 2: no check, no device read of the scale
    assert "nan_guard/loss_scale" not in io.scalars
    run(io, guard, 4)  # iteration 3: a periodic check, the scale comes with it
    assert io.scalars["nan_guard/loss_scale"] == 65536.0


def test_snapshot_copies_are_waited_for_only_when_a_rollback_reads_them(tmp_path, monkeypatch):
    # On CUDA a snapshot's device-to-host copies are asynchronous: the host must not wait for them on healthy
    # steps, and must wait before it reads one back. A stand-in event records when it is waited for.
    import petr_stability.core.recovery.restore as guard_module

    io = FakeIO(str(tmp_path), mode="dynamic")
    events = []

    class Event:
        def __init__(self):
            self.waited_before_restores = None
            events.append(self)

        def synchronize(self):
            assert self.waited_before_restores is None, "waited twice"
            self.waited_before_restores = len(io.restores)

    monkeypatch.setattr(guard_module, "copies_done", lambda pin, device=None: Event())
    guard = make_guard(io)
    run(io, guard, 16)
    assert len(events) >= 3 and all(e.waited_before_restores is None for e in events)  # healthy: no waits
    run(io, guard, 26, faults={17: "weights"})
    assert io.restores == [10]
    waited = [e for e in events if e.waited_before_restores is not None]
    assert len(waited) == 1 and waited[0].waited_before_restores == 0  # the restored one, before the restore


def test_the_first_skip_of_a_streak_keeps_where_the_trouble_started_and_bad_data_returns_there(tmp_path):
    # Issue 35: a restore point where the trouble starts. The first skipped step of a streak (after an applied step)
    # leaves the last applied step's weights: kept, in the ring's memory, as the restore point for a class whose state
    # was fine (bad data, a forward overflow). The dynamics ladder never takes it while unconfirmed.
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io, snapshot_interval=20, confirm_steps=5, check_interval=50)
    run(io, guard, 33)
    kept = [s for s in guard.points.ring.snapshots if s.at_trouble]
    assert kept == []
    run(io, guard, 34, faults={33: "grad"})  # iteration 34 skips: the streak starts there
    (trouble,) = [s for s in guard.points.ring.snapshots if s.at_trouble]
    assert trouble.iteration == 34 and len(guard.points.ring) <= guard.config.keep_snapshots  # no more memory
    assert guard.points.next(40, set(), trouble_first=True).iteration == 34
    assert guard.points.next(40, set(), trouble_first=False).iteration == 20  # confirmed, the ladder's


@pytest.mark.parametrize("grew, restored", [(False, 34), (True, 20)])
def test_an_overflow_the_weights_grew_into_rolls_back_to_a_confirmed_state_not_where_the_streak_began(
        tmp_path, monkeypatch, grew, restored):
    # Issue 43: the state where a skip streak began is healthy for an overflow the healthy weights show too (every
    # batch, or this batch's data): the run goes on from there. An overflow the weights grew into says that state is
    # the grown one: it lies on the growth's path, and the run goes back to its newest confirmed state, as for dynamics.
    import petr_stability.core.recovery.chain as chain_module
    from petr_stability.core.causes import Cause, Classification

    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io, snapshot_interval=20, confirm_steps=5, check_interval=50)
    cls = Classification(Cause.FORWARD_OVERFLOW, "the out layer's fp16 forward overflows", modules=["out"],
                         signals={"weights_grew": grew})
    monkeypatch.setattr(chain_module._Divergence, "classify", lambda self, chain, inc: cls)
    run(io, guard, 36, faults={33: "grad"})  # iteration 34 skips: the streak starts there (its restore point)
    assert [s.iteration for s in guard.points.ring.snapshots if s.at_trouble] == [34]
    run(io, guard, 40, faults={37: "weights"})
    (rec,) = [r for r in read_incidents(str(tmp_path)) if r["event"] == "divergence"]
    assert rec["cause"]["cause"] == "forward_overflow" and rec["restored_from"]["iteration"] == restored
    assert io.restores == [restored]


def test_a_state_taken_during_a_loss_explosion_comes_after_the_start_state(tmp_path):
    # Issue 43: healthy means stable. A snapshot taken since the run left its stability band (its first unstable step
    # since the newest healthy state: T) lies on the explosion's path: a rollback takes the states from before T, newest
    # first, then the run's start state, and only then those taken since T.
    io = FakeIO(str(tmp_path), mode="dynamic")
    guard = make_guard(io, snapshot_interval=5, confirm_steps=50, check_interval=50)  # nothing gets confirmed
    run(io, guard, 12)
    assert [s.iteration for s in guard.points.ring.snapshots] == [1, 5, 10] and guard.points.start.iteration == 0

    def order(**kw):
        tried, out = set(), []
        for _ in range(4):
            payload = guard.points.next(12, tried, **kw)
            out.append(payload.iteration if payload.source == "memory" else payload.source)
        return out

    assert order() == [10, 5, 1, "start"]
    assert order(unstable_since=7) == [5, 1, "start", 10]
    assert order(unstable_since=3) == [1, "start", 10, 5]
