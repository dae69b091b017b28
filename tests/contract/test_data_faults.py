"""Data faults never end a run (issue 27), over every runner family installed here.

The triggers are data: samples with NaN pixels (a corrupt image as it decodes), one after another (a burst), more of
them than the quarantine's bound, one corrupt sample that a dataset wrapper serves under many indices (CBGS,
repeat), and a burst under gradient accumulation (issue 33). Each run counts what its dataset serves, per index: no
good sample is ever quarantined, and a quarantined one is never served again under any index.
"""
import math

import pytest
from families import FAMILIES, GUARD, LR

from petr_stability import read_incidents
from petr_stability.core.errors import BadDataError
from petr_stability.core.wrappers import sample_of
from petr_stability.testing.data_faults import assert_windows_line_up, named_indices, tuned_targets, watch_steps
from petr_stability.testing.wrappers import CBGSLike, Counted, RepeatLike

NAMES = [name for name, _ in FAMILIES]
BUILD = dict(FAMILIES)
#: Whether a corrupt sample is named the first time it breaks a step: the runners' PETR-shaped model has a BatchNorm,
#: which NaN pixels poison (a divergence, replayed); the torch loop's has none, so NaN features only make the scaler
#: skip steps, and a sample is named once steps were skipped on it twice (two epochs, or two indices).
FIRST_SIGHT = {"torch_loop": False, "mmengine": True, "mmcv1": True}


def build(family, work_dir, iters, guard=None, wrap=None, **kwargs):
    run = BUILD[family](str(work_dir), iters, dict(GUARD, **(guard or {})), [], "norm", **kwargs)
    leaf = run.wrap_dataset(Counted)
    outer = run.wrap_dataset(lambda d: wrap(d)) if wrap is not None else leaf
    return run, leaf, outer


def fetches(run):
    """What the training loader fetched per leaf index: the :class:`Counted` leaf of the live loader's dataset (an
    MMEngine runner builds its loader from a deep copy of the dataset it was given)."""
    live = run.live_dataset()
    for _ in range(8):
        if isinstance(live, Counted):
            return live.fetches
        live = live.dataset
    raise LookupError("no Counted leaf under the training loader's dataset")


def per_epoch(run, outer) -> int:
    return len(outer) // run.batch_size


def records(tmp_path):
    return [r for r in read_incidents(str(tmp_path)) if r["event"] == "divergence"]


def assert_data_only(tmp_path):
    """Every divergence was classed data and changed no hyperparameter."""
    found = records(tmp_path)
    assert all(r["cause"]["cause"] == "data" for r in found), [r["cause"] for r in found]
    assert not tuned_targets(found)


@pytest.mark.parametrize("family", NAMES)
def test_a_burst_of_bad_batches_is_data_batch_by_batch(family, tmp_path):
    # One corrupt sample in each of three consecutive batches: each batch is data (the batch known to be good trains
    # fine on the healthy weights), never "every batch breaks".
    run, leaf, outer = build(family, tmp_path, iters=0, guard=dict(quarantine_fraction=0.25))
    first = per_epoch(run, outer) // 2 - 1
    bad = [(first + k) * run.batch_size + 1 for k in range(3)]
    iters = 2 * per_epoch(run, outer) + 2
    _set_iters(run, iters)
    for i in bad:
        run.corrupt(i)
    run.train()
    assert run.completed() == iters and run.params_finite()
    assert sorted(run.guard.remedy("quarantine").skip_list) == bad  # every bad sample, no good one
    # Served at most twice (a step skipped on it in two epochs decides too), never again once quarantined.
    served = fetches(run)
    assert all(1 <= served[i] <= 2 for i in bad), {i: served[i] for i in bad}
    assert_data_only(tmp_path)


@pytest.mark.parametrize("family", NAMES)
def test_a_burst_under_gradient_accumulation_leaves_no_partial_window_behind(family, tmp_path, monkeypatch):
    # Issue 33: the optimizer steps every 4 iterations; three consecutive batches hold a corrupt sample each (NaN,
    # Inf, NaN pixels), from the middle of a window over its boundary, each caught as it is served (a health check
    # every iteration, inside windows too). After every rollback the next window starts from zero gradients, the
    # optimizer steps on the same iterations as in an uninterrupted run, and only the bad samples are named.
    every = 4
    steps = watch_steps(monkeypatch)
    run, leaf, outer = build(family, tmp_path, iters=0, guard=dict(quarantine_fraction=0.25, check_interval=1),
                             accumulate=every)
    n = per_epoch(run, outer)
    first = n // 2 - 1
    bad = [(first + k) * run.batch_size + 1 for k in range(3)]
    iters = every * max(3, (n + n // 2) // every)
    _set_iters(run, iters)
    for i, value in zip(bad, (math.nan, math.inf, math.nan)):
        run.corrupt(i, value)
    dropouts = run.dropouts()
    run.train()
    assert run.completed() == iters and run.params_finite()
    # Where a corrupt sample breaks a step at once (BatchNorm: a divergence) the run rolls back; where it only makes
    # the window's step skip (no state it touches), nothing rolls back and the samples the window's batches hold are
    # named by their own values at that step, quarantined at the second: both ways, no window carried over.
    rollbacks = assert_windows_line_up(run.grad_reads, steps, every)
    assert rollbacks >= 1 if FIRST_SIGHT[family] else rollbacks == 0
    found = read_incidents(str(tmp_path))
    assert set(named_indices(found)) == set(bad), found  # the bad samples alone, in every record
    assert sorted(run.guard.remedy("quarantine").skip_list) == bad
    served = 1 if FIRST_SIGHT[family] else 2  # quarantined where first served, or where named a second time
    assert all(fetches(run)[i] == served for i in bad), {i: fetches(run)[i] for i in bad}
    assert_data_only(tmp_path)
    assert run.clip_kwargs()["max_norm"] == 35 and run.lr() == LR and run.dropouts() == dropouts


@pytest.mark.parametrize("family", NAMES)
def test_a_refused_quarantine_skips_the_batch_and_says_so(family, tmp_path):
    # Two corrupt samples, a bound of one: the second is refused, recorded as refused, its batch skipped; the run
    # goes on, and ends before the refused sample comes back.
    run, bad, iters = _two_bad_samples(family, tmp_path, passes=1 if FIRST_SIGHT[family] else 2)
    run.train()
    assert run.completed() == iters and run.params_finite()
    assert list(run.guard.remedy("quarantine").skip_list) == bad[:1]
    refused = [(r, named) for r, named in _named(tmp_path, "refused")]
    assert refused and all(s.get("index") == bad[1] for _, named in refused for s in named)
    assert "refused" in _why(refused[-1][0]) and ("skipped" in _why(refused[-1][0]) or not refused[-1][0]["actions"])
    assert_data_only(tmp_path)


@pytest.mark.parametrize("family", NAMES)
def test_refused_samples_that_break_again_stop_with_a_data_error_naming_every_bad_sample(family, tmp_path):
    run, bad, _ = _two_bad_samples(family, tmp_path, passes=3)
    with pytest.raises(BadDataError) as err:
        run.train()
    message = str(err.value)
    assert all(f"index={i}" in message for i in bad), message
    assert "data" in message and "quarantine=" in message
    assert sorted(err.value.samples_indices) == bad
    assert list(run.guard.remedy("quarantine").skip_list) == bad[:1]  # the bound held; nothing good was taken
    stops = [r for r in read_incidents(str(tmp_path)) if r["event"] == "gave_up"]
    assert len(stops) == 1 and all(f"index={i}" in stops[0]["why"] for i in bad)
    if family == "torch_loop":  # the loop's config has the hook entry: the next run starts without every bad sample
        text = (tmp_path / "nan_guard_patched_config.py").read_text()  # every bad sample, by what it is
        assert "quarantine=[" in text and all(f"inner_index={i}," in text for i in bad)


def _bad_mid_pass(run, outer):
    """Each leaf sample's outer indices, the iterations of one pass, and a sample first drawn near the middle of the
    first pass and drawn again later in it (the one to corrupt)."""
    copies = {}
    for i in range(len(outer)):
        copies.setdefault(sample_of(outer, i).index, []).append(i)
    n = per_epoch(run, outer)
    bad = next(s for s, where in sorted(copies.items(), key=lambda kv: kv[1][0])
               if len(where) >= 3 and where[0] >= (n // 4) * run.batch_size)
    return copies, n, bad


@pytest.mark.parametrize("family", NAMES)
@pytest.mark.parametrize("wrapper", ["cbgs", "repeat"])
def test_one_bad_sample_inside_a_resampling_wrapper_is_quarantined_under_every_index(family, wrapper, tmp_path):
    wrap = {"cbgs": lambda d: CBGSLike(d, copies=3), "repeat": lambda d: RepeatLike(d, 3)}[wrapper]
    run, leaf, outer = build(family, tmp_path, iters=0, guard=dict(quarantine_fraction=0.1), wrap=wrap)
    copies, n, bad = _bad_mid_pass(run, outer)
    _set_iters(run, n + 2)
    run.corrupt(bad)
    run.train()
    assert run.completed() == n + 2 and run.params_finite()
    skip = run.guard.remedy("quarantine").skip_list
    assert sorted(skip) == copies[bad]  # every outer index of the sample, nothing else
    # Served at most twice (once where it broke a step, once more where a skipped step named it again), never
    # again under any of its other indices.
    assert 1 <= fetches(run)[bad] <= 2 < len(copies[bad]), (fetches(run)[bad], copies[bad])
    ((rec, named),) = _named(tmp_path, "quarantined")
    assert named[0]["inner_index"] == bad and named[0]["served_as"] == copies[bad]
    assert_data_only(tmp_path)


def _two_bad_samples(family, tmp_path, passes):
    """A run of ``passes`` passes over the data (default bound: one sample) with two corrupt samples, one mid-pass
    and one in the last batch of each pass; (run, their indices, iterations)."""
    run, _, outer = build(family, tmp_path, iters=0)
    n = per_epoch(run, outer)
    bad = [(n // 2 - 1) * run.batch_size + 1, (n - 1) * run.batch_size + 1]
    _set_iters(run, passes * n)
    for i in bad:
        run.corrupt(i)
    return run, bad, passes * n


def _named(tmp_path, how):
    """(record, samples) for each record that quarantined (``how='quarantined'``) or refused samples: a data
    divergence's class signals, or a recurring sample's record."""
    out = []
    for r in read_incidents(str(tmp_path)):
        signals = (r.get("cause") or {}).get("signals") or {}
        if signals.get(how):
            out.append((r, signals[how]))
        elif r["event"] == "recurring_sample" and (r.get("quarantined") is True) == (how == "quarantined"):
            out.append((r, r.get("batch") or []))
    return out


def _why(record):
    return (record.get("cause") or {}).get("evidence") or record.get("reason") or ""


def _set_iters(run, iters):
    """The run's length, set after it was built (its loader's size is only known once wrapped)."""
    run.iters = iters
    runner = getattr(run, "runner", None)
    if isinstance(getattr(runner, "_train_loop", None), dict):  # MMEngine: the loop is built by train()
        runner._train_loop["max_iters"] = iters
    elif runner is not None:  # MMCV 1.x IterBasedRunner
        runner._max_iters = iters


@pytest.mark.parametrize("family", NAMES)
def test_the_next_run_keeps_a_quarantined_sample_out_whatever_its_resampler_draws(family, tmp_path):
    # Issue 33: run 1 quarantines a corrupt sample inside a CBGS-like resampler under every copy its table drew; the
    # next run draws another table (another seed) with another batch size. What the patched config carries names
    # the sample by what it is, resolved through run 2's own table before its first batch: the corrupt sample is never
    # fetched, nothing breaks, and no good sample loses a copy (before: run 1's outer indices, which in run 2 serve
    # good samples, while the corrupt one came back under its new indices and broke the run again).
    wrap = lambda seed: lambda d: CBGSLike(d, copies=3, seed=seed)  # noqa: E731
    run, leaf, outer = build(family, tmp_path / "run1", iters=0, guard=dict(quarantine_fraction=0.1), wrap=wrap(0))
    copies, n, bad = _bad_mid_pass(run, outer)
    _set_iters(run, n + 2)
    run.corrupt(bad)
    run.train()
    assert sorted(run.guard.remedy("quarantine").skip_list) == copies[bad]
    carried = run.guard.config_fix().quarantine
    assert len(carried) == 1 and carried[0]["inner_index"] == bad and "index" not in carried[0], carried
    ((rec, named),) = _named(tmp_path / "run1", "quarantined")
    assert rec["cause"]["signals"]["stored"] == carried  # the record says what the next run is given
    if family == "torch_loop":  # the loop's config has the hook entry
        text = (tmp_path / "run1" / "nan_guard_patched_config.py").read_text()
        assert f"inner_index={bad}" in text and "served_as" not in text

    def second(name, quarantine, corrupt):
        again, _, table = build(family, tmp_path / name, iters=0, guard=dict(quarantine_fraction=0.1,
                                                                               quarantine=quarantine), wrap=wrap(1))
        again.set_batch_size(2 * run.batch_size)
        _set_iters(again, per_epoch(again, table))
        if corrupt:
            again.corrupt(bad)
        again.train()
        assert again.params_finite()
        return again, table

    run2, table = second("run2", carried, corrupt=True)
    assert sorted(run2.guard.remedy("quarantine").skip_list) == [i for i in range(len(table))
                                                                   if sample_of(table, i).index == bad]
    assert read_incidents(str(tmp_path / "run2")) == []
    base, _ = second("base", [], corrupt=False)  # run 2 as it trains without any quarantine (and nothing corrupt)
    got, want = fetches(run2), fetches(base)
    assert got[bad] == 0 < want[bad]
    good = [i for i in range(len(leaf)) if i != bad]
    assert all(got[i] >= want[i] for i in good), {i: (got[i], want[i]) for i in good if got[i] < want[i]}
    assert sum(got[i] - want[i] for i in good) == want[bad]  # the substitutes fill exactly the bad sample's slots
