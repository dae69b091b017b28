"""The run's own statistics of loss and grad_norm (pure Python on host floats, no torch): the stable band a healthy
step stays in (:class:`StabilityWatch`), and a NaN-safe running z-score of grad_norm for spike warnings and an
adaptive clip bound (:class:`GradNormMonitor`).

Healthy means stable: each applied step's loss and grad_norm against a robust band of the run's own recent history.

A state is a restore point the replay may trust only when the steps after it were stable, not merely finite: a run
whose training loss climbs into the thousands is finite for a while and already on its divergent path. The band is the
median of the log values over a window, plus the larger of ``z`` robust standard deviations (the median absolute
deviation, x 1.4826) and ``log(ratio)``: a step is unstable when its loss or grad_norm passes it, upwards only (a
falling loss is what training does). Both tests must hold, as llm-foundry's ``KillLossSpike`` (a multiple of the
window mean) and OLMo-core / torchtitan (a z-score) each use one: a z-score alone fires on a smooth loss's tiny
noise, a ratio alone on grad_norm's heavy tail. A run with no stable regime to judge by (the loss swinging by more
than ``ratio`` from one applied step to the next, the median of the last few swings: a rate far too high from its
first steps) is unstable throughout: its band is too wide to be a band. A loss ``ratio`` times below the run's first
applied losses is never judged: near its floor a loss swings between batches without anything exploding; and a loss
that was ever <= 0 (a signed objective) has no log scale: grad_norm alone is judged then.
"""
import math
import statistics
from collections import deque
from typing import Any, Deque, Dict, Iterable, List, Optional, Tuple

__all__ = ["GradNormMonitor", "SPIKE_RATIO", "StabilityWatch", "MAD_SIGMA", "SWING_STEPS", "GRAD_NORM_Z"]

#: A spike is warned about when it is at least this many times the running mean, besides its z-score.
SPIKE_RATIO = 3.0


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


class GradNormMonitor:
    """Running mean and standard deviation of the last ``window`` finite grad_norm values.

    Fed once per optimizer step with the grad_norm the runner already logged as a host float (no device
    read). Non-finite values (a loss scaler's overflow steps) are left out of the statistics. A value above
    ``mean + z * std`` of the values before it enters the window at that bound, not at its raw size (as ZClip
    does), so one spike does not widen the bound for the next. It is warned about only when it is also at least
    :data:`SPIKE_RATIO` times the mean (llm-foundry's ``KillLossSpike`` test): grad_norm is heavy-tailed, and a
    z-score alone fires on healthy runs now and then.

    Args:
        window: how many recent finite values the statistics cover. Defaults to 100.
        z: how many standard deviations above the mean a spike starts. Defaults to 3.0.
        warmup: finite values needed before warnings and the adaptive bound start. Defaults to 25.
    """

    def __init__(self, window: int = 100, z: float = 3.0, warmup: int = 25) -> None:
        _check_int("window", window, 2)
        _check_positive("z", z)
        _check_int("warmup", warmup, 2)
        self.window = window
        self.z = float(z)
        self.warmup = warmup
        self._values: Deque[float] = deque(maxlen=window)
        self.count = 0  # finite values observed in all
        self.steps = 0  # observe() calls, finite or not
        self.in_spike = False

    @property
    def ready(self) -> bool:
        """True once ``warmup`` finite values were seen."""
        return self.count >= self.warmup and len(self._values) >= 2

    @property
    def mean(self) -> float:
        """Mean of the window (NaN while empty)."""
        return math.fsum(self._values) / len(self._values) if self._values else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation of the window (NaN while empty)."""
        if not self._values:
            return math.nan
        mean = self.mean
        return math.sqrt(math.fsum((v - mean) ** 2 for v in self._values) / len(self._values))

    def _bound(self) -> float:
        return self.mean + self.z * self.std

    def observe(self, grad_norm: float, iteration: Optional[int] = None) -> Optional[str]:
        """Adds one step's grad_norm; returns a warning text on the first step of a spike, else None.

        Args:
            grad_norm: the step's gradient norm as a host float (NaN/Inf allowed: skipped).
            iteration: the step's 1-based iteration, for the warning. Defaults to None (the warning counts the
                steps observed).
        """
        if isinstance(grad_norm, bool) or not isinstance(grad_norm, (int, float)):
            raise TypeError(f"grad_norm must be a number, got {grad_norm!r}")
        self.steps += 1
        value = float(grad_norm)
        if not math.isfinite(value):
            return None
        warning = None
        if self.ready:
            mean, std = self.mean, self.std
            bound = mean + self.z * std
            if value > bound:
                if not self.in_spike and value >= SPIKE_RATIO * mean:
                    where = f"iter {iteration}" if iteration is not None else f"step {self.steps}"
                    warning = (f"grad_norm spike at {where}: {value:.4g} > mean {mean:.4g} + {self.z:g} x std "
                               f"{std:.4g} = {bound:.4g}, {value / mean:.3g} x the mean (last "
                               f"{len(self._values)} steps)")
                self.in_spike = True
                value = bound
            else:
                self.in_spike = False
        self._values.append(value)
        self.count += 1
        return warning

    def clip_bound(self, max_norm: float) -> float:
        """Adaptive clip: ``min(max_norm, mean + z * std)`` once warmed up, else ``max_norm``.

        Args:
            max_norm: the configured bound; the result is never looser.
        """
        _check_positive("max_norm", max_norm)
        if not self.ready:
            return float(max_norm)
        bound = self._bound()
        if not math.isfinite(bound) or bound <= 0:
            return float(max_norm)
        return min(float(max_norm), bound)

    def state_dict(self) -> Dict[str, Any]:
        """Everything :meth:`load_state_dict` needs to continue exactly."""
        return {"version": 1, "values": list(self._values), "count": self.count, "steps": self.steps,
                "in_spike": self.in_spike}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output; missing keys take their fresh values."""
        self._values = deque((float(v) for v in state.get("values", [])), maxlen=self.window)
        self.count = int(state.get("count", len(self._values)))
        self.steps = int(state.get("steps", self.count))
        self.in_spike = bool(state.get("in_spike", False))


#: grad_norm is judged at this many times ``stability_z`` (its tail is heavy; the loss's is not).
GRAD_NORM_Z = 2.0

#: How many step-to-step swings of the loss :class:`StabilityWatch` keeps (a stable regime needs a calm median).
SWING_STEPS = 8
#: Unstable steps remembered by iteration (:meth:`StabilityWatch.unstable_after`): those since the newest healthy
#: state matter, and a healthy state is one ``confirm_steps`` stable steps followed.
UNSTABLE_KEPT = 64

#: The median absolute deviation of a normal distribution times this is its standard deviation.
MAD_SIGMA = 1.4826


class _Band:
    """The window of one signal's log values and its upper bound."""

    def __init__(self, window: int) -> None:
        self.values: Deque[float] = deque(maxlen=window)
        self._cached: Optional[Tuple[float, float]] = None  # (median, bound) of the values as they stand

    def load(self, values: Iterable[float]) -> None:
        self.values = deque(values, maxlen=self.values.maxlen)
        self._cached = None

    def add(self, value: float) -> None:
        self.values.append(value)
        self._cached = None

    def stats(self, z: float, ratio: float) -> Tuple[float, float]:
        """(median, upper bound) of the log values: read once per step however often asked."""
        if self._cached is None:
            median = statistics.median(self.values)
            mad = statistics.median(abs(v - median) for v in self.values) * MAD_SIGMA
            self._cached = (median, median + max(z * mad, math.log(ratio)))
        return self._cached


class StabilityWatch:
    """Judges each applied step stable or not by the run's own history of loss and grad_norm.

    :meth:`judge` reads a step (nothing changes); :meth:`update` adds it once its verdict is agreed (across ranks, the
    most severe wins: a step one rank finds unstable is unstable on all). An unstable value stays out of the window, so
    an explosion does not widen the band it is judged by (entered at the band's bound, as ZClip clips, twenty of them
    widened the zoo's CNN's band from 19x to 66x its median within the explosion); a level the run keeps for half a
    window without diverging becomes the band.

    Args:
        window: how many recent stable steps the band covers. Defaults to 50.
        z: robust standard deviations above the median (log scale) before a value is out of band. Defaults to 3.0.
        ratio: and at least this many times the median. Defaults to 4.0.
        warmup: values needed before any step is judged (the first iterations are stable). Defaults to 5.
    """

    def __init__(self, window: int = 50, z: float = 3.0, ratio: float = 4.0, warmup: int = 5) -> None:
        for name, value, low in (("stability_window", window, 2), ("stability_warmup", warmup, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name, value, low in (("stability_z", z, 0.0), ("stability_ratio", ratio, 1.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low < value < math.inf):
                raise ValueError(f"{name} must be a finite number > {low:g}, got {value!r}")
        self.window, self.z, self.ratio, self.warmup = window, float(z), float(ratio), warmup
        self.bands = {"loss": _Band(window), "grad_norm": _Band(window)}
        #: Each signal's unstable values in a row (log), kept out of its band.
        self.held: Dict[str, List[float]] = {"loss": [], "grad_norm": []}
        #: |change of log loss| between consecutive applied steps, the last few: a run whose loss swings by more than
        #: ``ratio`` from step to step (the median of them) has no stable regime to judge a step by.
        self.swings: Deque[float] = deque(maxlen=SWING_STEPS)
        self.last_log_loss: Optional[float] = None
        #: The run's first applied losses (log): a loss ``ratio`` times below their median is no explosion however it
        #: moves (a classifier near its floor swings 0.002 -> 0.05 between batches).
        self.early: List[float] = []
        #: False once an applied step's loss was <= 0: a signed loss has no log scale, only grad_norm is judged then.
        self.loss_positive = True
        self.seen = 0  #: stable-or-not applied steps added so far
        self.unstable_steps = 0  #: applied steps judged unstable so far
        self.trouble_since: Optional[int] = None  #: the first unstable step of the trouble in course, or None
        #: The latest unstable steps of this path, in order, for :meth:`unstable_after` (a step numbered at or below
        #: one of them follows a rollback: the abandoned path's are dropped).
        self.unstable_at: Deque[int] = deque(maxlen=UNSTABLE_KEPT)
        self.calm = 0  #: stable applied steps in a row: trouble ends after SWING_STEPS // 2 of them

    @staticmethod
    def _log(value: Optional[float]) -> Optional[float]:
        if value is None or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            return None
        return math.log(value)

    def _floor(self) -> float:
        """log of the level no loss below is judged: the early losses' median over ``ratio``."""
        return statistics.median(self.early) - math.log(self.ratio) if self.early else -math.inf

    def _floored(self, logged: Optional[float]) -> Optional[float]:
        return None if logged is None else max(logged, self._floor())

    def judge(self, loss: Optional[float], grad_norm: Optional[float]) -> Optional[str]:
        """Why this applied, finite step is out of band (a text naming the signal, its value and the band), or None
        (stable; also while warming up, and for values that are absent, non-finite or not positive)."""
        if self.seen < self.warmup:
            return None
        loss = loss if self.loss_positive else None
        logged = self._floored(self._log(loss))
        if logged is not None and self.last_log_loss is not None and len(self.swings) >= SWING_STEPS // 2:
            swing = math.exp(statistics.median(list(self.swings) + [abs(logged - self.last_log_loss)]))
            if swing > self.ratio:
                return (f"the loss swings {swing:.3g}x from one applied step to the next (the median over the last "
                        f"{len(self.swings) + 1}), more than {self.ratio:g}x: no stable regime")
        for name, value in (("loss", loss), ("grad_norm", grad_norm)):
            logged, band = self._log(value), self.bands[name]
            if logged is None or len(band.values) < 2:
                continue
            # grad_norm's tail is heavy (a healthy run's lognormal sigma reaches 0.6): twice the z-score there.
            z = self.z * (GRAD_NORM_Z if name == "grad_norm" else 1.0)
            median, bound = band.stats(z, self.ratio)
            if logged > bound and (name != "loss" or logged > self._floor()):
                return (f"{name} {value:.4g} is {value / math.exp(median):.3g}x its median {math.exp(median):.4g} over "
                        f"the last {len(band.values)} steps, past the band ({math.exp(bound):.4g}: z={z:g} "
                        f"robust sigmas and at least {self.ratio:g}x)")
        return None

    def update(self, loss: Optional[float], grad_norm: Optional[float], unstable: bool, iteration: int) -> bool:
        """Adds one applied step with its agreed judgement; returns whether it starts trouble (the first unstable step
        after stable ones)."""
        self.seen += 1
        while self.unstable_at and self.unstable_at[-1] >= iteration:  # rolled back: the abandoned path's
            self.unstable_at.pop()
        if unstable:
            self.unstable_at.append(iteration)
        if loss is not None and math.isfinite(loss) and loss <= 0:
            self.loss_positive = False
        loss = loss if self.loss_positive else None
        if len(self.early) < self.warmup and self._log(loss) is not None:
            self.early.append(self._log(loss))
        logged = self._floored(self._log(loss))
        if logged is not None:
            if self.last_log_loss is not None:
                self.swings.append(abs(logged - self.last_log_loss))
            self.last_log_loss = logged
        for name, value in (("loss", loss), ("grad_norm", grad_norm)):
            logged, band = self._log(value), self.bands[name]
            if logged is None:
                continue
            if not unstable:
                band.add(logged)
                self.held[name] = []
                continue
            # An unstable value stays out of the band (an explosion must not widen the band it is judged by), until
            # the run has kept that level for half a window without diverging: then it is the run's level.
            self.held[name].append(logged)
            if len(self.held[name]) >= max(2, self.window // 2):
                band.load(self.held[name])
                self.held[name] = []
        starts = unstable and self.trouble_since is None
        self.calm = 0 if unstable else self.calm + 1
        if unstable:
            self.unstable_steps += 1
            self.trouble_since = iteration if starts else self.trouble_since
        elif self.calm >= SWING_STEPS // 2:  # one stable step inside an explosion does not end it
            self.trouble_since = None
        return starts

    def unstable_after(self, iteration: int) -> Optional[int]:
        """The first step of this path judged unstable after ``iteration`` (among the last ``UNSTABLE_KEPT``), or
        None: stable since."""
        return next((i for i in self.unstable_at if i > iteration), None)

    def state_dict(self) -> Dict[str, Any]:
        """Everything :meth:`load_state_dict` needs to continue exactly (JSON-ready)."""
        return {"version": 1, "bands": {k: list(b.values) for k, b in self.bands.items()}, "seen": self.seen,
                "unstable_steps": self.unstable_steps, "trouble_since": self.trouble_since,
                "swings": list(self.swings), "last_log_loss": self.last_log_loss, "early": list(self.early),
                "held": {k: list(v) for k, v in self.held.items()}, "calm": self.calm,
                "loss_positive": self.loss_positive, "unstable_at": list(self.unstable_at)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output; missing keys take their fresh values (an older checkpoint)."""
        for name, band in self.bands.items():
            band.load(float(v) for v in state.get("bands", {}).get(name, []))
        self.swings = deque((float(v) for v in state.get("swings", [])), maxlen=SWING_STEPS)
        last = state.get("last_log_loss")
        self.last_log_loss = None if last is None else float(last)
        self.early = [float(v) for v in state.get("early", [])]
        self.calm = int(state.get("calm", 0))
        self.held = {k: [float(v) for v in dict(state.get("held") or {}).get(k, [])] for k in self.bands}
        self.loss_positive = bool(state.get("loss_positive", True))
        self.seen = int(state.get("seen", 0))
        self.unstable_steps = int(state.get("unstable_steps", 0))
        since = state.get("trouble_since")
        self.trouble_since = None if since is None else int(since)
        self.unstable_at = deque((int(i) for i in state.get("unstable_at", [])), maxlen=UNSTABLE_KEPT)
