"""Every example config loads, adds the guard and nothing else to switch on, and the patcher fixes it."""
import glob
import os

import pytest
from mmengine.config import Config
from mmengine.registry import HOOKS

import petr_stability
from petr_stability.configfix import ConfigFix, apply_fix, load_config

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "*.py")))


def test_there_are_three_example_configs():
    assert len(CONFIGS) == 3


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_loads_and_builds_the_guard(path):
    cfg = Config.fromfile(path, import_custom_modules=False)
    assert "petr_stability" in cfg.custom_imports["imports"]
    types = [h["type"] for h in cfg.custom_hooks]
    assert types == ["NanGuardHook"]  # the fire drill stays off
    hook = HOOKS.build(dict(cfg.custom_hooks[0]))
    assert isinstance(hook, petr_stability.NanGuardHook)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_has_the_seed_failure_settings_that_the_patcher_fixes(path):
    changes, _, _ = apply_fix(load_config(path), ConfigFix.known_manual_fix())
    paths = {c.path for c in changes}
    assert any("max_norm" in p for p in paths)
    assert sum("attn_cfgs" in p for p in paths) >= 2 and any("ffn_dropout" in p for p in paths)
    assert not any("backbone" in p for p in paths)
