"""MMEngine's visualizer steps (StepsRun): on the iteration axis they count the iterations run; validation metrics
follow LoggerHook's axis; a second run wraps the visualizer once. The contract (tests/contract/test_dashboards.py)
reads a real run's TensorBoard and scalars.json back; this covers what its runs do not reach (validation)."""
import types

import pytest
from mmengine.hooks import LoggerHook

from petr_stability.adapters.mmengine_runner.dashboards import StepsRun


class Recorder:
    """A visualizer's two scalar calls, with MMEngine's signatures."""

    def __init__(self):
        self.steps = []

    def add_scalars(self, scalar_dict, step=0, file_path=None, **kwargs):
        self.steps.append(step)

    def add_scalar(self, name, value, step=0, **kwargs):
        self.steps.append(step)


@pytest.mark.parametrize("by_epoch", [True, False])
def test_steps_on_the_iteration_axis_count_the_iterations_run(by_epoch):
    vis = Recorder()
    runner = types.SimpleNamespace(visualizer=vis, hooks=[LoggerHook(log_metric_by_epoch=by_epoch)])
    steps = StepsRun(runner)
    steps.lost = 7  # a rollback from 12 to 5
    vis.add_scalars({"loss": 1.0}, step=3)  # not in training: the caller's step
    steps.train()
    vis.add_scalars({"loss": 1.0}, step=6)  # LoggerHook after iteration 6 of the replay: the 13th run
    vis.add_scalar("x", 1.0, 6)  # positional, as other callers write it
    steps.validate()
    vis.add_scalars({"mAP": 0.5}, step=2 if by_epoch else 6)  # epoch 2, or iteration 6
    steps.off()
    vis.add_scalars({}, step=9)
    assert vis.steps == [3, 13, 13, 2 if by_epoch else 13, 9]


def test_a_second_run_wraps_the_visualizer_once():
    vis = Recorder()
    runner = types.SimpleNamespace(visualizer=vis, hooks=[])
    StepsRun(runner).lost = 7
    again = StepsRun(runner)
    again.train()
    vis.add_scalars({}, step=4)
    again.lost = 2
    vis.add_scalars({}, step=4)
    assert vis.steps == [4, 6]
