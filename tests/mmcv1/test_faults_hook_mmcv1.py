"""FaultInjectionHook on real MMCV 1.x runners: ``param`` is checked as the run starts (before any iteration), and
a fault planned past the run's last iteration is named in one warning (IterBasedRunner: ``max_iters``;
EpochBasedRunner: ``max_epochs`` x the loader's length)."""
import logging

import pytest
from harness import build_runner, run

ATTN = "net.pts_bbox_head.layers.0.attentions.0.attn"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def watch(r) -> Lines:
    handler = Lines()
    r.logger.addHandler(handler)
    return handler


def late(lines: Lines):
    return [m for m in lines.lines if "past the run's last iteration" in m]


def test_a_misspelled_param_stops_the_run_before_its_first_iteration(tmp_path):
    r = build_runner(str(tmp_path), runner="iter", amp=None, max_iters=4,
                     faults=[dict(kind="grads", iters=[2], param=f"{ATTN}.in_proj_wieght")])
    with pytest.raises(ValueError) as err:
        run(r)
    msg = str(err.value)
    assert f"grads fault at iters [2]: no parameter named '{ATTN}.in_proj_wieght'" in msg
    assert f"close names: '{ATTN}.in_proj_weight'" in msg
    assert r.iter == 0


def test_iter_based_a_fault_past_max_iters_is_warned_about_once_and_the_rest_fire(tmp_path):
    r = build_runner(str(tmp_path), runner="iter", amp=None, max_iters=3,
                     faults=[dict(kind="weights", iters=[2, 7], param=f"{ATTN}.in_proj_weight"),
                             dict(kind="loss", iters=[4, 5])])
    lines = watch(r)
    run(r)
    assert late(lines) == ["FaultInjectionHook: planned past the run's last iteration 3, these never fire: "
                           "weights fault at iters [7], loss fault at iters [4, 5]"]
    assert [m for m in lines.lines if "planted" in m] == [
        f"FaultInjectionHook: iter 2, rank 0: planted nan in weights ({ATTN}.in_proj_weight)"]


def test_epoch_based_counts_epochs_times_the_loader_length(tmp_path):
    # 16 samples at batch 2: 8 iterations per epoch, 16 in all.
    r = build_runner(str(tmp_path), runner="epoch", amp=None, max_epochs=2,
                     faults=[dict(kind="loss", iters=[16]), dict(kind="batch", iters=[17], value=2.0)])
    lines = watch(r)
    run(r)
    assert r.iter == 16
    assert late(lines) == ["FaultInjectionHook: planned past the run's last iteration 16, these never fire: "
                           "batch fault at iters [17]"]


def test_within_the_run_nothing_is_warned(tmp_path):
    r = build_runner(str(tmp_path), runner="epoch", amp=None, max_epochs=1, n_samples=4,
                     faults=[dict(kind="batch", iters=[2], value=2.0)])
    lines = watch(r)
    run(r)
    assert late(lines) == [] and len([m for m in lines.lines if "planted" in m]) == 1
