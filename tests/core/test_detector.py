"""Detector rules on both sides of every boundary, without a runner."""
import math
import re

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
        (dict(max_scale_fall=1), "max_scale_fall must be a number > 1"),
        (dict(max_scale_fall=True), "off), got True"),
        (dict(max_scale_fall="16"), "got '16'"),
    ],
)
def test_bad_thresholds_name_the_value(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        DetectorConfig(**kwargs)


# ---------------------------------------------------------------- a skip streak the scale no longer explains
# Measured on the demo's model (docs/demo.md, "Detecting sooner"): the scaler's calibration from 2**16 halves 6-7
# times before the first applied step; after one, ordinary streaks are one skip long; a forward that overflows fp16
# skips every step at every scale. max_scale_fall=16 fires at the fifth falling skip after an applied step.


def _applied(det, n=3, start=0):
    for i in range(start, start + n):
        assert step(det, i, grad=5.0) == Verdict.HEALTHY


def _streak(det, start, scale, n):
    """n skips, the scale halving each time (as a dynamic scaler backs off); their decisions."""
    out = []
    for i in range(start, start + n):
        scale /= 2
        out.append(det.observe(StepSignals(i, grad_norm=INF, loss=2.0, loss_scale=scale, scale_mode="dynamic")))
    return out


def test_calibration_at_the_start_never_fits_a_scale_nor_fires():
    # init_scale 2**30 (MMCV's PETR configs: 2**32 with a floor) halving 29 times before any step is applied:
    # nothing was fitted, so only min_loss_scale could end it, and it does not until below 1.
    det = DivergenceDetector()
    decisions = _streak(det, 1, 2.0 ** 30, 29)
    assert [d.verdict for d in decisions] == [Verdict.OVERFLOW] * 29
    assert det.fitted_scale is None and not any(d.streak_start for d in decisions)
    _applied(det, 1, start=30)
    assert det.fitted_scale is None  # a clean step alone reads no scale


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_harmless_burst_after_applied_steps_does_not_fire(n):
    det = DivergenceDetector()
    _applied(det)
    decisions = _streak(det, 3, 2048.0, n)
    assert [d.verdict for d in decisions] == [Verdict.OVERFLOW] * n
    assert [d.streak_start for d in decisions] == [True] + [False] * (n - 1)  # the restore point: its first skip
    assert det.fitted_scale == 1024.0
    _applied(det, 1, start=3 + n)
    # The next streak starts from the lower scale, and is measured against it.
    decisions = _streak(det, 10, 1024.0 / 2 ** n, 4)
    assert [d.verdict for d in decisions] == [Verdict.OVERFLOW] * 4
    assert det.fitted_scale == 512.0 / 2 ** n


WARM = DetectorConfig(fall_warmup=0)  # the fall rule's mechanics, as on a run past its warm-up


def test_streak_the_scale_no_longer_explains_fires_at_the_fifth_skip():
    det = DivergenceDetector(WARM)
    _applied(det)
    decisions = _streak(det, 3, 2048.0, 5)  # 1024, 512, 256, 128, 64
    assert [d.verdict for d in decisions] == [Verdict.OVERFLOW] * 4 + [Verdict.DIVERGED]
    assert "loss scale down to 64, 16x below the scale the gradients fitted (1024; max_scale_fall=16)" in (
        decisions[-1].reason)
    # Against min_loss_scale alone this streak would have gone on to 0.5: eleven skips.
    late = DivergenceDetector(DetectorConfig(max_scale_fall=math.inf))
    _applied(late)
    verdicts = [d.verdict for d in _streak(late, 3, 2048.0, 12)]
    assert verdicts.index(Verdict.DIVERGED) == 11


def test_the_fall_rule_waits_for_the_runs_warm_up():
    # Measured on the model zoo's causal transformer at its stable rate: the scale fitted after 2 applied steps falls
    # 16x as the warming-up rate grows the gradients, and a healthy scaler settles by itself. Not a divergence then.
    det = DivergenceDetector()
    _applied(det, 2)
    assert [d.verdict for d in _streak(det, 2, 2048.0, 8)] == [Verdict.OVERFLOW] * 8  # down to 8
    warm = DivergenceDetector(DetectorConfig(fall_warmup=20))
    _applied(warm, 20)
    assert [d.verdict for d in _streak(warm, 20, 2048.0, 5)] == [Verdict.OVERFLOW] * 4 + [Verdict.DIVERGED]
    assert warm.state_dict()["applied_steps"] == 20
    with pytest.raises(ValueError, match="fall_warmup must be an integer >= 0, got -1"):
        DetectorConfig(fall_warmup=-1)


def test_after_a_rollback_the_fitted_scale_holds_and_a_start_state_calibrates_again():
    det = DivergenceDetector(WARM)
    _applied(det)
    _streak(det, 3, 1024.0, 2)  # fitted 512
    det.reset()  # a rollback
    assert det.fitted_scale == 512.0 and not det.applied
    # Rolled back to the run's start state: the scale calibrates from 2**16 back down to the fitted level.
    decisions = _streak(det, 1, 2.0 ** 16, 7)  # down to 512
    assert [d.verdict for d in decisions] == [Verdict.OVERFLOW] * 7 and not any(d.streak_start for d in decisions)
    # Rolled back to a mid-run state whose next steps overflow at once: measured against the fitted scale.
    det.reset()
    decisions = _streak(det, 20, 512.0, 4)  # 256, 128, 64, 32
    assert [d.verdict for d in decisions] == [Verdict.OVERFLOW] * 3 + [Verdict.DIVERGED]


def test_static_scale_and_fp32_are_untouched_by_the_fall_rule():
    det = DivergenceDetector()
    _applied(det)
    for i in range(4):
        d = det.observe(StepSignals(3 + i, grad_norm=INF, loss=1.0, loss_scale=512.0, scale_mode="static"))
        assert d.verdict == Verdict.OVERFLOW and not d.streak_start
    assert det.fitted_scale is None


def test_fall_rule_state_round_trip():
    det = DivergenceDetector()
    _applied(det)
    _streak(det, 3, 1024.0, 2)
    other = DivergenceDetector()
    other.load_state_dict(det.state_dict())
    assert other.state_dict() == det.state_dict() and other.fitted_scale == 512.0
    other.load_state_dict({})
    assert other.fitted_scale is None and other.applied is False


def test_resumed_scaler_calibrating_from_its_init_scale_does_not_fire():
    # A checkpoint saved after applied steps, resumed with a scaler that starts again from 2**16: the first skip
    # after the resume is no evidence of a fitted 2**15, so the calibration down to the saved fitted level is quiet.
    det = DivergenceDetector()
    _applied(det)
    _streak(det, 3, 1024.0, 1)  # fitted 512
    _applied(det, 2, start=4)
    resumed = DivergenceDetector()
    resumed.load_state_dict(det.state_dict())
    decisions = _streak(resumed, 6, 2.0 ** 16, 7)
    assert [d.verdict for d in decisions] == [Verdict.OVERFLOW] * 7 and resumed.fitted_scale == 512.0
