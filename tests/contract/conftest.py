"""The contract suite imports its families from this folder; MMCV 1.x runners skip their epoch sleeps here too."""
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _no_runner_sleep(monkeypatch):
    from petr_stability.testing.stacks import has_mmcv1

    if has_mmcv1():
        from mmcv.runner import epoch_based_runner, iter_based_runner

        fake = types.SimpleNamespace(sleep=lambda s: None)
        monkeypatch.setattr(epoch_based_runner, "time", fake)
        monkeypatch.setattr(iter_based_runner, "time", fake)
