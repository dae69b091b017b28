"""Detector rules on both sides of every boundary, without a runner."""
import math

import pytest

from petr_stability.core.watch.detector import DetectorConfig, DivergenceDetector, StepSignals, Verdict

NAN, INF = math.nan, math.inf


def step(det, i, grad=1.0, loss=1.0, scale=None, mode="dynamic", **kw):
    return det.observe(StepSignals(i, grad_norm=grad, loss=loss, loss_scale=scale, scale_mode=mode, **kw)).verdict


def test_isolated_overflow_under_dynamic_scale_is_harmless():
    det = DivergenceDetector()
    assert step(det, 0) == Verdict.HEALTHY
    assert step(det, 1, grad=INF, scale=32768.0) == Verdict.OVERFLOW
    assert step(det, 2) == Verdict.HEALTHY
    assert det.overflow_streak == 0


def test_calibration_run_of_overflows_with_falling_scale_is_harmless():
    # init_scale=2**30 halves ~14 times in a row before the first clean step; the loss stays finite.
    det = DivergenceDetector()
    scale = 2.0 ** 30
    for i in range(14):
        scale /= 2
        assert step(det, i, grad=INF, scale=scale) == Verdict.OVERFLOW
    assert step(det, 14) == Verdict.HEALTHY


@pytest.mark.parametrize("k", [2, 3, 4])
def test_scale_no_longer_falling_diverges_at_exactly_k(k):
    det = DivergenceDetector(DetectorConfig(patience=k))
    verdicts = [step(det, 0, grad=INF, scale=8.0)]  # first of a run: nothing to compare with
    verdicts += [step(det, i, grad=NAN, scale=8.0) for i in range(1, k + 1)]
    assert verdicts[:k] == [Verdict.OVERFLOW] * k
    assert verdicts[k] == Verdict.DIVERGED


def test_stuck_streak_resets_when_scale_falls_again():
    det = DivergenceDetector(DetectorConfig(patience=3))
    assert step(det, 0, grad=INF, scale=8.0) == Verdict.OVERFLOW
    assert step(det, 1, grad=INF, scale=8.0) == Verdict.OVERFLOW  # stuck 1
    assert step(det, 2, grad=INF, scale=8.0) == Verdict.OVERFLOW  # stuck 2
    assert step(det, 3, grad=INF, scale=4.0) == Verdict.OVERFLOW  # fell: reset
    assert det.stuck_streak == 0


def test_dynamic_scale_below_min_diverges_and_at_min_does_not():
    det = DivergenceDetector(DetectorConfig(min_loss_scale=1.0))
    assert step(det, 0, grad=INF, scale=1.0) == Verdict.OVERFLOW
    assert step(det, 1, grad=INF, scale=0.5) == Verdict.DIVERGED


def test_consecutive_nonfinite_losses_diverge_at_k_not_before():
    det = DivergenceDetector(DetectorConfig(patience=3))
    scale = 1024.0
    out = []
    for i in range(3):
        scale /= 2
        out.append(step(det, i, grad=NAN, loss=NAN, scale=scale))
    assert out == [Verdict.OVERFLOW, Verdict.OVERFLOW, Verdict.DIVERGED]


def test_nonfinite_loss_streak_broken_by_finite_loss():
    det = DivergenceDetector(DetectorConfig(patience=3))
    step(det, 0, grad=NAN, loss=NAN, scale=512.0)
    step(det, 1, grad=NAN, loss=NAN, scale=256.0)
    assert step(det, 2, grad=INF, loss=2.0, scale=128.0) == Verdict.OVERFLOW
    assert det.loss_streak == 0


def test_nonfinite_weights_diverge_at_once_even_with_finite_loss():
    # PETR's head wraps its losses in nan_to_num: the loss reads 0.0 while the weights are NaN.
    det = DivergenceDetector()
    assert step(det, 0, grad=NAN, loss=0.0, scale=65536.0, weights_finite=False) == Verdict.DIVERGED


def test_fp32_applied_nonfinite_gradient_diverges_at_once():
    det = DivergenceDetector()
    assert step(det, 0, grad=NAN, mode="none") == Verdict.DIVERGED


@pytest.mark.parametrize("k", [1, 3])
def test_fp32_nonfinite_loss_with_finite_gradients_takes_patience_steps_and_says_so(k):
    # A logging-only loss term went NaN: the gradients (and so the weights) are fine. Not "applied a non-finite
    # gradient", and not a divergence before k in a row.
    det = DivergenceDetector(DetectorConfig(patience=k))
    for i in range(k - 1):
        d = det.observe(StepSignals(i, grad_norm=0.4769, loss=NAN, scale_mode="none"))
        assert d.verdict == Verdict.OVERFLOW and "non-finite loss with finite gradients" in d.reason
        assert "applied a non-finite gradient" not in d.reason
    d = det.observe(StepSignals(k, grad_norm=0.4769, loss=NAN, scale_mode="none"))
    assert d.verdict == Verdict.DIVERGED and d.reason.startswith(f"{k} consecutive non-finite losses")


def test_fp32_nonfinite_loss_streak_resets_on_a_finite_loss():
    det = DivergenceDetector()
    for i in range(2):
        assert step(det, i, grad=0.5, loss=NAN, mode="none") == Verdict.OVERFLOW
    assert step(det, 2, grad=0.5, loss=1.0, mode="none") == Verdict.HEALTHY
    assert step(det, 3, grad=0.5, loss=NAN, mode="none") == Verdict.OVERFLOW  # a new streak of 1


def test_fp32_nonfinite_gradient_applied_names_the_gradient():
    d = DivergenceDetector().observe(StepSignals(0, grad_norm=INF, loss=1.0, scale_mode="none"))
    assert d.verdict == Verdict.DIVERGED and d.reason.startswith("fp32 step applied a non-finite gradient")


def test_fp32_skipped_steps_count_like_overflows():
    det = DivergenceDetector(DetectorConfig(patience=3))
    out = [step(det, i, grad=NAN, mode="none", step_applied=False) for i in range(3)]
    assert out == [Verdict.OVERFLOW, Verdict.OVERFLOW, Verdict.DIVERGED]


@pytest.mark.parametrize("m", [1, 5])
def test_static_scale_stalls_after_m_skips(m):
    det = DivergenceDetector(DetectorConfig(static_patience=m))
    out = [step(det, i, grad=INF, scale=512.0, mode="static") for i in range(m)]
    assert out[:-1] == [Verdict.OVERFLOW] * (m - 1)
    assert out[-1] == Verdict.STALLED


def test_non_stepping_iterations_change_nothing():
    det = DivergenceDetector()
    step(det, 0, grad=INF, scale=8.0)
    assert step(det, 1, grad=None, loss=NAN, stepped=False) == Verdict.HEALTHY
    assert det.overflow_streak == 1


def test_state_round_trip_and_old_state_loads():
    det = DivergenceDetector()
    step(det, 0, grad=INF, scale=8.0)
    step(det, 1, grad=INF, scale=8.0)
    other = DivergenceDetector()
    other.load_state_dict(det.state_dict())
    assert other.state_dict() == det.state_dict()
    other.load_state_dict({})  # a checkpoint from before these keys existed
    assert other.overflow_streak == 0


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(patience=0), "patience must be an integer >= 1, got 0"),
        (dict(static_patience=-2), "static_patience must be an integer >= 1, got -2"),
        (dict(patience=2.5), "got 2.5"),
        (dict(min_loss_scale=0), "min_loss_scale must be a finite number > 0, got 0"),
        (dict(min_loss_scale=math.inf), "got inf"),
    ],
)
def test_bad_thresholds_name_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        DetectorConfig(**kwargs)
