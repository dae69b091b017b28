"""GradNormMonitor: the running z-score of grad_norm, its spike warnings, adaptive clip bound and state."""
import math
import statistics

import pytest

from petr_stability.core.watch.spikes import GradNormMonitor


def _feed(monitor, values):
    return [monitor.observe(v) for v in values]


def test_arguments_are_validated_and_named():
    for kwargs, text in (
        (dict(window=1), "window must be an integer >= 2, got 1"),
        (dict(window=True), "window must be an integer >= 2, got True"),
        (dict(window=2.5), "window must be an integer >= 2, got 2.5"),
        (dict(warmup=1), "warmup must be an integer >= 2, got 1"),
        (dict(z=0), "z must be a finite number > 0, got 0"),
        (dict(z=math.nan), "z must be a finite number > 0, got nan"),
        (dict(z="3"), "z must be a finite number > 0, got '3'"),
    ):
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(".", r"\.")):
            GradNormMonitor(**kwargs)
    monitor = GradNormMonitor()
    for bad in (0, -1.0, math.inf, math.nan, "1"):
        with pytest.raises(ValueError, match=f"max_norm must be a finite number > 0, got {bad!r}"):
            monitor.clip_bound(bad)
    with pytest.raises(TypeError, match="grad_norm must be a number, got None"):
        monitor.observe(None)


def test_no_warning_during_warmup_and_on_steady_values():
    monitor = GradNormMonitor(window=20, z=3.0, warmup=5)
    assert _feed(monitor, [100.0, 1.0, 50.0, 2.0]) == [None] * 4  # wild, but still warming up
    monitor = GradNormMonitor(window=20, z=3.0, warmup=5)
    assert all(w is None for w in _feed(monitor, [1.0, 1.1, 0.9, 1.0, 1.05, 0.95] * 5))


def test_warns_once_when_a_spike_starts_and_again_after_it_ends():
    monitor = GradNormMonitor(window=20, z=3.0, warmup=5)
    _feed(monitor, [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.02])
    first = monitor.observe(10.0, iteration=9)
    assert first is not None and first.startswith("grad_norm spike at iter 9: 10 >") and "9.98 x the mean" in first
    assert monitor.observe(12.0) is None  # the same spike goes on: no second warning
    assert monitor.observe(1.0) is None  # back under the bound
    assert monitor.observe(11.0) is not None  # a new spike starts


def test_nonfinite_values_are_skipped_not_counted():
    monitor = GradNormMonitor(window=10, z=3.0, warmup=3)
    assert _feed(monitor, [math.inf, math.nan, 1.0, 1.2, math.inf]) == [None] * 5
    assert monitor.count == 2  # the loss scaler's overflows are not grad_norm statistics
    assert math.isfinite(monitor.mean) and math.isfinite(monitor.std)
    assert monitor.observe(1.1) is None


def test_clip_bound_is_mean_plus_z_std_never_looser_than_max_norm():
    monitor = GradNormMonitor(window=50, z=2.0, warmup=4)
    assert monitor.clip_bound(35.0) == 35.0  # nothing seen yet: the configured bound
    values = [2.0, 3.0, 4.0, 3.0, 2.0, 4.0]
    _feed(monitor, values)
    expected = statistics.fmean(values) + 2.0 * statistics.pstdev(values)
    assert monitor.clip_bound(35.0) == pytest.approx(expected)
    assert monitor.clip_bound(1.0) == 1.0  # tighter configured bound wins
    assert monitor.mean == pytest.approx(statistics.fmean(values))
    assert monitor.std == pytest.approx(statistics.pstdev(values))


def test_window_forgets_old_values_and_spikes_enter_clipped():
    monitor = GradNormMonitor(window=4, z=1.0, warmup=2)
    _feed(monitor, [100.0, 100.0, 100.0, 100.0, 1.0, 1.0, 1.0, 1.0])
    assert monitor.mean == pytest.approx(1.0)  # the old level left the window
    # A spike enters the statistics at the bound it broke (as ZClip does), not at its raw size.
    monitor = GradNormMonitor(window=10, z=3.0, warmup=2)
    assert _feed(monitor, [1.0, 1.2, 1.0, 1.2, 1.1]) == [None] * 5
    bound = monitor.mean + 3.0 * monitor.std
    assert monitor.observe(1000.0) is not None
    assert max(monitor.state_dict()["values"]) == pytest.approx(bound)


def test_state_round_trip_and_old_state_loads():
    monitor = GradNormMonitor(window=8, z=2.5, warmup=3)
    _feed(monitor, [1.0, 2.0, 1.5, 9.0, 1.2])
    state = monitor.state_dict()
    other = GradNormMonitor(window=8, z=2.5, warmup=3)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.clip_bound(35.0) == monitor.clip_bound(35.0)
    assert other.observe(1.1) == monitor.observe(1.1)
    # A state from before a key existed (or an empty one) loads with defaults.
    empty = GradNormMonitor(window=8, z=2.5, warmup=3)
    empty.load_state_dict({})
    assert empty.count == 0 and empty.clip_bound(35.0) == 35.0
    # Values beyond the window are cut to the newest ones.
    small = GradNormMonitor(window=2, z=2.5, warmup=2)
    small.load_state_dict(state)
    assert small.state_dict()["values"] == state["values"][-2:]


def test_a_spike_is_warned_about_only_when_it_is_also_three_times_the_mean():
    # Heavy-tailed but healthy: a value past mean + 3 std, yet under 3 x the mean, is not a spike to warn about.
    monitor = GradNormMonitor(window=20, z=3.0, warmup=5)
    _feed(monitor, [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.01])
    assert monitor.observe(1.5, iteration=9) is None and monitor.in_spike  # the bound, not the warning
    assert monitor.observe(1.0) is None
    assert monitor.observe(3.5, iteration=11) is not None

