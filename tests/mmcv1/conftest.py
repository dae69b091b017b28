"""Fixtures for the MMCV 1.x suite: the runners' epoch-transition sleeps (2 s each) are skipped."""
import types

import pytest
from mmcv.runner import epoch_based_runner, iter_based_runner


@pytest.fixture(autouse=True)
def _no_runner_sleep(monkeypatch):
    fake = types.SimpleNamespace(sleep=lambda s: None)
    monkeypatch.setattr(epoch_based_runner, "time", fake)
    monkeypatch.setattr(iter_based_runner, "time", fake)
