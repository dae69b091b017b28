"""Healthy means stable (petr_stability/core/watch/spikes.py): the run's own band of loss and grad_norm, and the
snapshot ring confirming a state only after stable steps in a row."""
import json
import math
import random

import pytest

from petr_stability.core.recovery.snapshot import Snapshot, SnapshotRing
from petr_stability.core.watch.spikes import SWING_STEPS, StabilityWatch


def _healthy_run(watch: StabilityWatch, steps: int, seed: int = 0, start: int = 1) -> int:
    """A decreasing, noisy loss and a heavy-tailed grad_norm, as healthy training shows them; returns how many steps
    were judged unstable."""
    rng = random.Random(seed)
    unstable = 0
    for i in range(start, start + steps):
        loss = 3.0 * math.exp(-i / 150) * math.exp(rng.gauss(0, 0.15))
        grad_norm = 2.0 * math.exp(rng.gauss(0, 0.6))
        why = watch.judge(loss, grad_norm)
        unstable += why is not None
        watch.update(loss, grad_norm, why is not None, i)
    return unstable


@pytest.mark.parametrize("seed", range(5))
def test_a_healthy_run_is_stable_throughout(seed):
    watch = StabilityWatch()
    assert _healthy_run(watch, 400, seed) == 0 and watch.unstable_steps == 0 and watch.trouble_since is None


def test_an_explosion_is_trouble_from_its_first_step_and_does_not_widen_the_band():
    watch = StabilityWatch()
    _healthy_run(watch, 100)
    starts = []
    for i, loss in enumerate([30.0, 300.0, 3000.0, 3e4], start=101):
        why = watch.judge(loss, 2.0)
        assert why is not None and why.startswith(f"loss {loss:.4g} is"), why
        starts.append(watch.update(loss, 2.0, True, i))
    assert starts == [True, False, False, False] and watch.trouble_since == 101 and watch.unstable_steps == 4
    # Entered at the bound, not at their size: the band still judges the next explosion out of it.
    assert watch.judge(300.0, 2.0) is not None
    # Back in band, the loss still swinging 10x from step to step: no stable regime until the swings calm down.
    reasons = []
    for i in range(105, 105 + 2 * SWING_STEPS):
        why = watch.judge(2.0, 2.0)
        reasons.append(why)
        watch.update(2.0, 2.0, why is not None, i)
    assert "swings" in reasons[0] and reasons[-1] is None and watch.trouble_since is None
    # Trouble ends after a few stable steps in a row, not at the first one.
    assert reasons[-SWING_STEPS // 2 - 1:] == [None] * (SWING_STEPS // 2 + 1)


def test_a_loss_that_swings_wildly_from_step_to_step_is_no_stable_regime():
    # A rate far too high from its first steps: 0.2, 79, 0.4, 122, 0.5, ... (the zoo's temporal model at 8x): the
    # band over such values is too wide to be one; the swings themselves say it is not stable.
    watch, unstable = StabilityWatch(), []
    for i, loss in enumerate([0.2, 79.0, 80.0, 0.4, 2.1, 3.0, 122.0, 0.5, 1.6e5, 4.7e4, 41.0, 1.3e4, 1059.0], 1):
        why = watch.judge(loss, 1.0)
        unstable.append(why is not None)
        watch.update(loss, 1.0, why is not None, i)
    assert unstable[-1] and "swings" in (watch.judge(2300.0, 1.0) or "")
    assert not any(unstable[:5])  # warm-up


def test_a_grad_norm_explosion_is_trouble_and_the_tail_of_an_ordinary_grad_norm_is_not():
    watch = StabilityWatch()
    _healthy_run(watch, 100)
    assert watch.judge(1.0, 2.0 * 3.0) is None  # 3x the median: grad_norm's ordinary tail
    why = watch.judge(1.0, 2000.0)
    assert why is not None and why.startswith("grad_norm 2000 is")


def test_warmup_absent_and_nonpositive_values_are_never_judged():
    watch = StabilityWatch(warmup=5)
    for i in range(5):
        assert watch.judge(1e9 if i else 1.0, None) is None  # the first values: warm-up
        watch.update(1.0, None, False, i + 1)
    assert watch.judge(None, None) is None and watch.judge(-5.0, 0.0) is None and watch.judge(math.nan, None) is None
    assert watch.judge(100.0, None) is not None


def test_state_round_trip_continues_exactly():
    a = StabilityWatch()
    _healthy_run(a, 60)
    a.update(50.0, 2.0, True, 61)
    b = StabilityWatch()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    for loss in (2.0, 20.0, 200.0):
        assert b.judge(loss, 3.0) == a.judge(loss, 3.0)
    fresh = StabilityWatch()
    fresh.load_state_dict({})  # an older checkpoint: nothing kept
    assert fresh.seen == 0 and fresh.trouble_since is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(window=1), "stability_window must be an integer >= 2, got 1"),
    (dict(warmup=0), "stability_warmup must be an integer >= 1, got 0"),
    (dict(z=-1.0), "stability_z must be a finite number > 0, got -1.0"),
    (dict(ratio=1.0), "stability_ratio must be a finite number > 1, got 1.0"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StabilityWatch(**kwargs)


def test_an_unstable_step_confirms_nothing_and_restarts_the_count_of_unconfirmed_snapshots():
    ring = SnapshotRing(keep=3, confirm_steps=3)
    old, new = Snapshot(10, 0, {}), Snapshot(20, 0, {})
    ring.add(old)
    for _ in range(3):
        ring.tick()
    ring.add(new)
    ring.tick()
    ring.tick()
    assert ring.is_confirmed(old) and not ring.is_confirmed(new)
    ring.tick(stable=False)  # trouble: the newer state is on its path; the confirmed one stays confirmed
    assert ring.is_confirmed(old) and new.clean_steps == 0
    ring.tick()
    ring.tick()
    assert not ring.is_confirmed(new) and ring.newest_confirmed() is old
    ring.tick()
    assert ring.newest_confirmed() is new  # three stable steps in a row


def test_no_snapshot_taken_since_trouble_started_is_confirmed_while_it_lasts():
    ring = SnapshotRing(keep=3, confirm_steps=2)
    before, during = Snapshot(8, 0, {}), Snapshot(10, 0, {})
    ring.add(before)
    ring.tick()
    ring.tick()
    ring.trouble_since = 10  # iteration 10 left the band; its state was taken after it
    ring.add(during)
    ring.tick(stable=False)
    ring.tick()
    ring.tick()  # two stable steps in a row, but the trouble is in course
    assert during.clean_steps == 2 and not ring.is_confirmed(during) and ring.newest_confirmed() is before
    ring.tick(stable=False)  # still on the trouble's path: its count starts again
    assert during.clean_steps == 0 and ring.is_confirmed(before)
    ring.tick()
    ring.tick()
    ring.trouble_since = None  # calm long enough: the trouble is over
    assert ring.newest_confirmed() is during


def test_a_loss_near_its_floor_swinging_between_batches_is_stable():
    # A classifier fit to 0.002 with a hard batch at 0.05 now and then: 25x its median, far below its first losses.
    watch = StabilityWatch()
    for i, loss in enumerate([1.4, 1.2, 0.9, 0.7, 0.5] + [0.002, 0.05, 0.001, 0.03, 0.002] * 8, 1):
        assert watch.judge(loss, 1.0) is None, (i, loss)
        watch.update(loss, 1.0, False, i)
    assert watch.judge(1.0, 1.0) is not None  # back at the starting level: that is an explosion


def test_a_signed_loss_is_judged_by_grad_norm_alone():
    watch = StabilityWatch()
    for i, loss in enumerate([0.5, -0.3, 0.05, 0.6, -0.2, 0.01, 0.4] * 4, 1):
        assert watch.judge(loss, 2.0) is None
        watch.update(loss, 2.0, False, i)
    assert not watch.loss_positive and watch.judge(1e6, 2.0) is None and watch.judge(0.1, 2000.0) is not None


def test_unstable_steps_are_remembered_per_path_and_survive_a_resume():
    # unstable_since of an incident: the first step judged unstable after the newest healthy state, a trouble since
    # ended included. A rollback starts a new path: the abandoned path's unstable steps no longer count.
    w = StabilityWatch(window=10, warmup=2)
    for it in range(1, 13):
        w.update(1.0, 1.0, it in (6, 9), it)
    assert w.trouble_since == 6 and w.unstable_after(0) == 6 and w.unstable_after(6) == 9
    for it in range(13, 20):  # calm: the trouble ends, the steps stay remembered
        w.update(1.0, 1.0, False, it)
    assert w.trouble_since is None and w.unstable_after(5) == 6 and w.unstable_after(9) is None
    again = StabilityWatch(window=10, warmup=2)
    again.load_state_dict(w.state_dict())
    assert again.unstable_after(0) == 6 and again.unstable_after(6) == 9
    again.update(1.0, 1.0, False, 8)  # rolled back to 7: step 9 was on the abandoned path, 6 was not
    assert again.unstable_after(0) == 6 and again.unstable_after(6) is None
    again.update(1.0, 1.0, False, 3)
    assert again.unstable_after(0) is None
