"""FaultInjectionHook on a real MMEngine runner: ``param`` is checked as the run starts (before any iteration), and
a fault planned past the run's last iteration is named in one warning (iteration- and epoch-based loops)."""
import logging

import pytest
from harness import build_runner
from mmengine.logging import MMLogger

SMALL = dict(num_layers=1, num_query=16)
ATTN = "net.pts_bbox_head.layers.0.attentions.0.attn"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def watch(runner) -> Lines:
    handler = Lines()
    logger = MMLogger.get_current_instance()
    assert logger.instance_name == runner.logger.instance_name
    logger.addHandler(handler)
    return handler


def test_a_misspelled_param_stops_the_run_before_its_first_iteration(tmp_path):
    runner = build_runner(str(tmp_path), amp=None, max_iters=4, model_kwargs=SMALL, n_samples=8,
                          faults=[dict(kind="weights", iters=[2], param=f"{ATTN}.in_proj_weihgt")])
    with pytest.raises(ValueError) as err:
        runner.train()
    msg = str(err.value)
    assert f"no parameter or buffer named '{ATTN}.in_proj_weihgt'" in msg
    assert f"close names: '{ATTN}.in_proj_weight'" in msg
    assert runner.iter == 0


def test_a_fault_past_max_iters_is_warned_about_once_and_the_rest_fire(tmp_path):
    runner = build_runner(str(tmp_path), amp=None, max_iters=3, model_kwargs=SMALL, n_samples=8,
                          faults=[dict(kind="weights", iters=[2, 9], param=f"{ATTN}.in_proj_weight"),
                                  dict(kind="loss", iters=[3])])
    lines = watch(runner)
    runner.train()
    late = [m for m in lines.lines if "past the run's last iteration" in m]
    assert late == ["FaultInjectionHook: planned past the run's last iteration 3, these never fire: "
                    "weights fault at iters [9]"]
    assert [m for m in lines.lines if "planted" in m][0].startswith("FaultInjectionHook: iter 2, rank 0: planted")


def test_an_epoch_based_run_counts_epochs_times_the_loader_length(tmp_path):
    # 8 samples at batch 2: 4 iterations per epoch, 8 in all.
    runner = build_runner(str(tmp_path), amp=None, max_iters=None, max_epochs=2, model_kwargs=SMALL, n_samples=8,
                          faults=[dict(kind="loss", iters=[8]), dict(kind="batch", iters=[9], value=2.0)])
    lines = watch(runner)
    runner.train()
    late = [m for m in lines.lines if "past the run's last iteration" in m]
    assert late == ["FaultInjectionHook: planned past the run's last iteration 8, these never fire: "
                    "batch fault at iters [9]"]
