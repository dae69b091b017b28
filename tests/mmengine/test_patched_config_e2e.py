"""The patched config after an incident is the run's effective config (overrides in, fire drill out), both forms."""
from harness import build_runner
from mmengine.config import Config

from petr_stability import read_incidents
from petr_stability.testing.petr_like import SEED_LAYER_CFG

CONFIG = """
model = dict(type='PETRLikeModel', pts_bbox_head=dict(transformer=dict(decoder=dict(transformerlayers={layer}))))
optim_wrapper = dict(type='OptimWrapper', clip_grad=dict(max_norm=35, norm_type=2))
train_dataloader = dict(batch_size=4, num_workers=2)
custom_hooks = [dict(type='FaultInjectionHook', faults=[dict(kind='weights', iters=[12])]), dict(type='NanGuardHook')]
"""


def _run(tmp_path, edit_file_after_launch):
    src = tmp_path / "petr_cfg.py"
    src.write_text(CONFIG.format(layer=repr(SEED_LAYER_CFG)))
    cfg = Config.fromfile(str(src))
    cfg.merge_from_dict({"train_dataloader.batch_size": 2})  # what --cfg-options does
    wd = tmp_path / "wd"
    runner = build_runner(str(wd), amp="dynamic", max_iters=16, guard=dict(snapshot_interval=5, confirm_steps=3),
                          model_kwargs=dict(num_layers=1, num_query=16),
                          faults=[dict(kind="weights", iters=[12], value="nan")], cfg=cfg)
    if edit_file_after_launch:
        src.write_text(src.read_text().replace("batch_size=4", "batch_size=64"))  # an edit since launch
    runner.train()
    (rec,) = read_incidents(str(wd))
    assert rec["event"] == "divergence"
    return Config.fromfile(str(wd / "nan_guard_patched_config.py")), (wd / "nan_guard_patched_config.py").read_text()


def test_patched_config_is_the_effective_config_without_the_fire_drill(tmp_path):
    patched, text = _run(tmp_path, edit_file_after_launch=False)
    assert patched.train_dataloader.batch_size == 2  # the override, not the file's 4
    assert patched.optim_wrapper.clip_grad.max_norm == 1.0
    assert [h["type"] for h in patched.custom_hooks] == ["NanGuardHook"]  # the fire drill is not replayed
    layer = patched.model.pts_bbox_head.transformer.decoder.transformerlayers
    assert layer["ffn_dropout"] == 0 and {a["dropout"] for a in layer["attn_cfgs"]} == {0}
    assert "_base_" in text  # a short child of the file the run started from


def test_an_edit_to_the_file_after_launch_does_not_leak_in(tmp_path):
    patched, _ = _run(tmp_path, edit_file_after_launch=True)
    # The patched file says what the run trained with, whatever the file on disk says now.
    assert patched.train_dataloader.batch_size == 2 and patched.train_dataloader.num_workers == 2
