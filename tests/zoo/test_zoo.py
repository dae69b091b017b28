"""The guard on the model zoo, seed 0 (petr_stability/testing/zoo.py; benchmarks/zoo.py runs every seed).

One test per model x scenario, each asserting what one seed can show: the unguarded run is lost where a fault is
planted; the guarded run finishes (no false stop), is not lost, gives its scenario's class (a data fault: exactly the
planted sample quarantined, no module in fp32, no learning-rate change; nothing planted: no incident record at all),
and ends with a held-out loss no worse than ``EVAL_BOUND`` times the same seed's reference run, beyond what another
order of the same data does to that model (``ORDER_FLOOR``). Each test reports
every criterion it misses, not only the first.

Before this round 21 of the 25 cells failed against the guard (docs/results/zoo_before_cpu.json); a cell it still
fails is marked (``KNOWN``, strict) with what it does: none since cnn_bn too_high_lr's overflow after a loss explosion
is answered as dynamics (docs/zoo.md).
"""
import pytest

from petr_stability.testing import zoo

SEED = 0

#: The guarded held-out loss may be this much above the same seed's reference. Measured (benchmarks/zoo.py, seeds 0-2,
#: native kernels, docs/results/zoo_before_cpu.json, detr and cnn_bn as they were then): a guarded run the guard
#: handled right (the right class, finished, not lost: 43 runs over data and nan_weights) ends 0.45-1.37x its seed's
#: reference, median 1.00; measured again with detr and cnn_bn as they are now (pre-norm detr without warm-up, cnn_bn
#: on SGD; seeds 0-2, native): all 45 such runs handled right, 0.74-1.37x, median 1.03 (the highest detr's seed 0
#: data runs). One sample fewer, a skipped step or a rollback sends these small runs down another path, as another
#: seed would (the reference's own worst seed of 0-19 is 1.30x its median for causal_ts, 1.31x for detr, 1.62x for
#: rnn). 1.4x passes all of them and still fails a recovery that costs the run (rnn too_high_lr: 1.85x; causal_ts
#: too_high_lr: 780x; cnn_bn too_high_lr: 2.6-3.6x, its features in fp32 and the rate halved once, still 4x the stable
#: rate). Under the default kernels detr's seed-0 data runs end 1.24x (0.125 against 0.101).
EVAL_BOUND = 1.4
#: What the data order alone does to one seed (issue 43): the worst ratio of the reshuffled reference (the reference
#: with its batches in another order) to the reference over seeds 0-19, native and portable kernels, per model
#: (docs/results/zoo_reshuffled_native_cpu.json, zoo_nan_weights_default_cpu.json). A rollback replays iterations on
#: other batches, so a recovered seed is held to EVAL_BOUND times this: a NaN rolled back alone lands 1.41x (cnn_bn)
#: and 1.49x (temporal) on seed 0 under the portable kernels, inside what another order does to those models; the
#: recoveries that cost a run (cnn_bn too_high_lr 3.2-3.4x before 407b8e0, causal_ts too_high_lr 780x before) fail it.
ORDER_FLOOR = {"causal_ts": 1.078, "detr": 1.477, "cnn_bn": 1.335, "temporal": 2.678, "rnn": 1.529}

_RUNS = {}


def _run(model, scenario, variant):
    key = (model, scenario, variant)
    if key not in _RUNS:
        _RUNS[key] = zoo.run(model, scenario, variant, SEED)
    return _RUNS[key]


def _failures(model, scenario):
    reference = _run(model, "none", "reference")
    guarded = _run(model, scenario, "guarded")
    failures = []
    if scenario != "none":
        unguarded = _run(model, scenario, "unguarded")
        if not unguarded.lost:
            failures.append(f"the unguarded run is not lost (scale {unguarded.loss_scale}, eval "
                            f"{unguarded.eval_loss}): the fault did not take")
    if not guarded.finished:
        failures.append(f"false stop: {guarded.error_type}: {(guarded.error_message or '')[:400]}")
    if guarded.lost:
        failures.append(f"the guarded run is lost (state finite {guarded.state_finite}, eval {guarded.eval_loss}, "
                        f"scale {guarded.loss_scale})")
    ok, why = zoo.right_class(guarded)
    if not ok:
        failures.append(f"wrong class: {why}; records: {_records(guarded)}")
    if reference.eval_loss is None:
        failures.append("the reference run has no finite held-out loss")
    elif guarded.eval_loss is None or guarded.eval_loss > bound(model) * reference.eval_loss:
        failures.append(f"held-out loss {guarded.eval_loss} against the reference's {reference.eval_loss:.4f} "
                        f"(bound {bound(model):.3g}x)")
    return failures


def bound(model):
    """The held-out loss a guarded seed may reach, over its reference's: EVAL_BOUND beyond the data order's floor."""
    return EVAL_BOUND * max(1.0, ORDER_FLOOR[model])


def _records(result):
    return [{k: r[k] for k in ("event", "iteration", "cause", "evidence", "targets", "quarantined")}
            for r in result.incidents][:6]


#: Cells the guard does not yet pass, each with what it does (strict: a fix makes the test fail until removed here).
#: Empty since the forward overflow a loss explosion led to is answered as dynamics (cnn_bn too_high_lr: 3.4x -> 1.10x
#: on seed 0, below).
KNOWN = {}


@pytest.mark.parametrize("scenario", zoo.SCENARIOS)
@pytest.mark.parametrize("model", zoo.MODELS)
@pytest.mark.numerics
def test_zoo(model, scenario, request):
    if (model, scenario) in KNOWN:
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=KNOWN[(model, scenario)]))
    failures = _failures(model, scenario)
    assert not failures, f"{model} / {scenario}, seed {SEED}:\n- " + "\n- ".join(failures)


@pytest.mark.numerics
def test_bright_sample_overflows_an_fp16_forward():
    """The bright sample is finite, finite in fp16, and overflows an fp16 forward of every model (built for seed 0)."""
    from torch.utils.data._utils.collate import default_collate

    for model in zoo.MODELS:
        spec = zoo.spec(model)
        train, _ = spec.datasets(SEED)
        index = zoo.planted_index(model, SEED)
        bright = zoo.plant_data(train, "bright_sample", index, spec.input_key)[index]
        x = bright[spec.input_key]
        assert bool(x.isfinite().all()) and float(x.abs().max()) < zoo.FP16_MAX, model
        assert zoo.fp16_overflows(spec.build(SEED), spec.forward, default_collate([bright])), model


@pytest.mark.parametrize("record, extra, quiet", [
    # rnn seed 13 (native): the scaler skipped a step whose forward overflowed; the guard wrote what it saw, no more
    (dict(event="skip", iteration=34, cause=None), {}, True),
    (dict(event="nonfinite_loss", iteration=3, cause=None), {}, True),
    (dict(event="divergence", iteration=34, cause="dynamics"), dict(iters_lost=20), False),
    (dict(event="recurring_sample", iteration=34, cause="data"), dict(quarantined=[6]), False),
    (dict(event="skip", iteration=34, cause=None), dict(lr_factor=0.5), False),  # a rate changed is an act
    (dict(event="skip", iteration=34, cause=None), dict(fp32_modules=["gru"]), False),
])
def test_nothing_planted_means_the_guard_did_nothing_not_that_it_wrote_nothing(record, extra, quiet):
    result = zoo.ZooResult("rnn", "none", "guarded", 13, 0.0125, incidents=[record], **extra)
    ok, why = zoo.right_class(result)
    assert ok is quiet, why


@pytest.mark.numerics
@pytest.mark.parametrize("model", ["detr", "temporal"])  # a shuffled loader; a model trained in order
def test_the_reshuffled_reference_is_the_same_data_in_another_order(model):
    # benchmarks/zoo.py holds the reference's quality criteria against it too: how far the reference lands from itself
    # when nothing but the order of its batches changes, as a rollback's replayed iterations change it.
    reference, other = _run(model, "none", "reference"), _run(model, "none", "reshuffled")
    assert other.finished and not other.lost and other.lr == reference.lr and not other.incidents
    assert sorted(other.served) == sorted(reference.served)  # every sample served as often
    assert other.eval_loss != reference.eval_loss  # another order is another path


@pytest.mark.numerics
@pytest.mark.parametrize("model", ["detr", "temporal"])
def test_the_reference_without_the_planted_sample_trains_on_every_other_sample(model):
    # benchmarks/zoo.py holds the data cells against it too: a guarded run quarantines the planted sample at its first
    # serving at best and trains on the rest; this reference never has it.
    reference, without = _run(model, "none", "reference"), _run(model, "none", "without")
    dropped = zoo.planted_index(model, SEED)
    assert without.finished and not without.lost and without.lr == reference.lr and not without.incidents
    assert len(without.served) == len(reference.served) - 1 and min(without.served) >= 1
    assert without.eval_loss != reference.eval_loss
    bright = _run(model, "bright_sample", "guarded")
    assert bright.planted == dropped and bright.quarantined == [dropped]  # the very sample the floor leaves out


@pytest.mark.numerics
def test_an_overflow_the_loss_explosion_led_to_is_answered_as_dynamics():
    # cnn_bn at 8x its rate: the loss explodes for several steps (the stability band's trouble), then the second
    # conv's fp16 forward overflows on weights the rate grew. Before, the class's own answer (the conv in fp32, the
    # rate halved, back to where the skip streak began: a state on the explosion's path) left the run at 4x its rate
    # on long weights: 3.4x the reference on this seed. The loss said the rate was the cause: the newest state from
    # before the trouble and the dynamics factor (lr_backoff), the conv in fp32 as well.
    from petr_stability.core.config import GuardConfig

    guarded = _run("cnn_bn", "too_high_lr", "guarded")
    (divergence,) = [r for r in guarded.incidents if r["event"] == "divergence"]
    assert divergence["cause"] == "forward_overflow" and "weights grew into the overflow" in divergence["evidence"]
    assert "left its stability band at iter" in divergence["evidence"], divergence["evidence"]
    assert guarded.lr_factor == GuardConfig().lr_backoff and guarded.fp32_modules == ["features"]
    since = int(divergence["evidence"].split("stability band at iter ")[1].split(",")[0])
    assert divergence["iteration"] - divergence["iterations_lost"] < since  # restored to a state before the trouble
