"""patch-config on MMEngine and MMCV 1.x configs: _base_, nested lists, every spelling, loads from anywhere."""
import copy
import os
import shutil
import subprocess
import sys

import pytest

from petr_stability.cli import main
from petr_stability.tools.patch_config import load_config, patch_config_dict, write_patched_config

DATA = os.path.join(os.path.dirname(__file__), "data")


def _paths(d, prefix=""):
    """Every leaf as (path, value)."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _paths(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            yield from _paths(v, f"{prefix}[{i}]")
    else:
        yield prefix, d


def _diff(a, b):
    pa, pb = dict(_paths(a)), dict(_paths(b))
    return {k: (pa.get(k), pb.get(k)) for k in set(pa) | set(pb) if pa.get(k) != pb.get(k)}


def _patch_elsewhere(tmp_path, name):
    out_dir = tmp_path / "elsewhere" / "deep"
    out = out_dir / "patched.py"
    assert main(["patch-config", os.path.join(DATA, name), "-o", str(out)]) == 0
    return str(out)


def test_mmengine_config_patched_and_nothing_else(tmp_path, capsys):
    original = load_config(os.path.join(DATA, "mmengine_petr.py"))
    out = _patch_elsewhere(tmp_path, "mmengine_petr.py")
    printed = capsys.readouterr().out
    patched = load_config(out)
    diff = _diff(original, patched)
    tl = "model.pts_bbox_head.transformer.decoder.transformerlayers"
    expected = {
        f"{tl}.attn_cfgs[0].attn_drop", f"{tl}.attn_cfgs[0].dropout_layer.drop_prob",
        f"{tl}.attn_cfgs[1].attn_drop", f"{tl}.attn_cfgs[1].proj_drop", f"{tl}.attn_cfgs[1].dropout_layer.drop_prob",
        f"{tl}.ffn_cfgs.ffn_drop", f"{tl}.ffn_dropout", "optim_wrapper.clip_grad.max_norm",
    }
    assert set(diff) == expected
    assert all(new == 0 for k, (_, new) in diff.items() if "max_norm" not in k)
    assert diff["optim_wrapper.clip_grad.max_norm"] == (35, 1)
    # _base_ merged: the child's overrides and the base's values are both there; backbone and neck untouched.
    assert patched["model"]["pts_bbox_head"]["num_query"] == 600
    assert patched["optim_wrapper"]["optimizer"] == dict(type="AdamW", lr=1e-4, weight_decay=0.01)
    assert patched["model"]["img_backbone"]["drop_path_rate"] == 0.1
    assert patched["model"]["img_neck"]["dropout"] == 0.2
    assert patched["embed"] == 256
    assert patched["custom_imports"]["imports"] == ["projects.PETR.petr", "no_such_package.plugin"]
    for k in expected:
        assert k in printed
    assert "8 change(s) (MMEngine config)" in printed


def test_mmcv1_config_list_of_layers(tmp_path, capsys):
    original = load_config(os.path.join(DATA, "mmcv1_petr.py"))
    patched = load_config(_patch_elsewhere(tmp_path, "mmcv1_petr.py"))
    diff = _diff(original, patched)
    tl = "model.pts_bbox_head.transformer.decoder.transformerlayers[0]"
    assert diff == {
        f"{tl}.attn_cfgs[0].dropout": (0.1, 0.0),
        f"{tl}.attn_cfgs[1].dropout": (0.1, 0.0),
        f"{tl}.ffn_dropout": (0.1, 0.0),
        "optimizer_config.grad_clip.max_norm": (35, 1),
    }
    assert patched["optimizer_config"]["loss_scale"] == 512.0
    assert patched["model"]["img_backbone"]["drop_path_rate"] == 0.2
    assert "MMCV 1.x" in capsys.readouterr().out


def test_tighter_clip_is_not_loosened(tmp_path, capsys):
    patched = load_config(_patch_elsewhere(tmp_path, "mmcv1_tight.py"))
    assert patched["optimizer_config"]["grad_clip"]["max_norm"] == 0.5
    assert "already 0.5" in capsys.readouterr().out


def test_missing_clip_is_added():
    cfg = load_config(os.path.join(DATA, "mmengine_petr.py"))
    cfg["optim_wrapper"].pop("clip_grad")
    changes, _, family = patch_config_dict(cfg)
    assert family == "mmengine"
    assert cfg["optim_wrapper"]["clip_grad"] == dict(max_norm=1, norm_type=2)
    assert any(c.path == "optim_wrapper.clip_grad" and c.old is None for c in changes)


def test_value_clip_left_alone():
    cfg = load_config(os.path.join(DATA, "mmengine_petr.py"))
    cfg["optim_wrapper"]["clip_grad"] = dict(type="value", clip_value=5)
    before = copy.deepcopy(cfg["optim_wrapper"])
    _, notes, _ = patch_config_dict(cfg)
    assert cfg["optim_wrapper"] == before
    assert any("clips by value" in n for n in notes)


def test_output_loads_with_mmengine_from_another_directory(tmp_path):
    out = _patch_elsewhere(tmp_path, "mmengine_petr.py")
    moved = tmp_path / "moved.py"
    shutil.move(out, moved)
    code = ("from mmengine.config import Config; "
            f"c = Config.fromfile({str(moved)!r}, import_custom_modules=False); "
            "print(c.optim_wrapper.clip_grad.max_norm, c.model.img_backbone.drop_path_rate)")
    res = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["1", "0.1"]


def test_write_patched_config_from_text(tmp_path):
    text = open(os.path.join(DATA, "_base_", "mmcv1_petr_base.py")).read()
    changes = write_patched_config(text, str(tmp_path / "w" / "fixed.py"))
    assert len(changes) == 4
    assert load_config(str(tmp_path / "w" / "fixed.py"))["optimizer_config"]["grad_clip"]["max_norm"] == 1
    assert write_patched_config(str(tmp_path / "w" / "fixed.py"), str(tmp_path / "again.py")) == []


def test_errors_name_the_bad_value(tmp_path, capsys):
    assert main(["patch-config", str(tmp_path / "nope.py"), "-o", str(tmp_path / "o.py")]) == 2
    assert "nope.py" in capsys.readouterr().err
    bad = tmp_path / "bad.py"
    bad.write_text("_base_ = './missing_base.py'\n")
    assert main(["patch-config", str(bad), "-o", str(tmp_path / "o.py")]) == 2
    assert "missing_base.py" in capsys.readouterr().err
    noopt = tmp_path / "noopt.py"
    noopt.write_text("model = dict(type='X')\n")
    assert main(["patch-config", str(noopt), "-o", str(tmp_path / "o.py")]) == 2
    assert "optim_wrapper" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0, got 0"):
        patch_config_dict(load_config(os.path.join(DATA, "mmcv1_petr.py")), max_norm=0)
