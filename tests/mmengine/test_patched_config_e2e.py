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
                          faults=[dict(kind="weights", iters=[12, 14], value="nan")], cfg=cfg)
    if edit_file_after_launch:
        src.write_text(src.read_text().replace("batch_size=4", "batch_size=64"))  # an edit since launch
    runner.train()
    # The first NaN written between two steps is rolled back alone (issue 43), the second gets the known manual fix.
    assert [r["event"] for r in read_incidents(str(wd))] == ["divergence", "divergence"]
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


def _flat(node, path=""):
    """Every leaf of a config as dotted path -> value (list items by index)."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{path}.{k}" if path else str(k)))
        return out
    if isinstance(node, (list, tuple)):
        out = {}
        for i, v in enumerate(node):
            out.update(_flat(v, f"{path}[{i}]"))
        return out or {path: []}
    return {path: node}


def _diff(before, after):
    a, b = _flat(before), _flat(after)
    return {k: (a.get(k, "<absent>"), b.get(k, "<absent>")) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def _incident_run(tmp_path, kind):
    """One incident of ``kind`` under a config with the hook (and nothing else to remove); the effective and the
    patched config as dicts, the incident record."""
    from petr_stability.testing.causes_models import overflow_layer_cfg

    layer = overflow_layer_cfg() if kind == "forward_overflow" else SEED_LAYER_CFG
    src = tmp_path / "cfg.py"
    src.write_text(CONFIG.format(layer=repr(layer)).replace(
        "custom_hooks = [dict(type='FaultInjectionHook', faults=[dict(kind='weights', iters=[12])]), "
        "dict(type='NanGuardHook')]", "custom_hooks = [dict(type='NanGuardHook')]"))
    cfg = Config.fromfile(str(src))
    faults = {"data": [dict(kind="batch", iters=[5], value=1e6)], "forward_overflow": [],
              "dynamics": [dict(kind="weights", iters=[12, 14], value="nan")]}[kind]  # 12: rolled back alone
    amp = dict(init_scale=1.0) if kind == "data" else dict(init_scale=8.0) if kind == "forward_overflow" else "dynamic"
    wd = tmp_path / "wd"
    runner = build_runner(str(wd), amp=amp, max_iters=16, faults=faults, cfg=cfg,
                          guard=dict(snapshot_interval=5, confirm_steps=3, quarantine_fraction=0.05),
                          model_kwargs=dict(num_layers=1, num_query=16, layer_cfg=layer))
    runner.train()
    divergences = [r for r in read_incidents(str(wd)) if r["event"] == "divergence"]
    assert len(divergences) == (2 if kind == "dynamics" else 1), divergences
    rec = divergences[-1]
    assert rec["cause"]["cause"] == kind, rec["cause"]
    patched = wd / "nan_guard_patched_config.py"
    return cfg.to_dict(), Config.fromfile(str(patched)).to_dict(), patched.read_text(), rec


def test_a_data_incident_writes_the_quarantine_and_nothing_else(tmp_path):
    before, after, text, rec = _incident_run(tmp_path, "data")
    # Each quarantined sample by what it is (its dataset and its index there), as the record says it was stored.
    stored = rec["cause"]["signals"]["stored"]
    assert [s["inner_index"] for s in stored] == [s["index"] for s in rec["cause"]["signals"]["quarantined"]]
    assert _diff(before, after) == {f"custom_hooks[0].quarantine[{i}].{k}": ("<absent>", v)
                                    for i, s in enumerate(stored) for k, v in s.items()}
    assert len(stored) == 2 and all(s == {"dataset": "ListDataset", "inner_index": s["inner_index"]} for s in stored)
    assert "2 sample(s) quarantined" in text and "max_norm" not in text.split("\n_base_")[0]


def test_a_forward_overflow_writes_the_fp32_module_and_nothing_else(tmp_path):
    before, after, text, rec = _incident_run(tmp_path, "forward_overflow")
    (module,) = rec["cause"]["modules"]
    assert _diff(before, after) == {"custom_hooks[0].fp32_modules[0]": ("<absent>", module)}
    assert f"fp32: {module}" in text


def test_a_dynamics_incident_writes_the_known_manual_fix_as_applied(tmp_path):
    before, after, text, rec = _incident_run(tmp_path, "dynamics")
    changed = _diff(before, after)
    assert changed.pop("optim_wrapper.clip_grad.max_norm") == (35, 1)
    # Every drop probability zeroed in the model, by module and attribute, rides in the hook entry too (a transformer
    # built in code, as torch's attention is, has no config key for it).
    from petr_stability.core.remedies.dropout import DROPOUT_FLOAT_ATTRS

    carried = {k: changed.pop(k) for k in list(changed) if k.startswith("custom_hooks[0].carry.dropout.zeroed[")}
    assert carried and all(old == "<absent>" and new.rpartition(".")[2] in ("p",) + DROPOUT_FLOAT_ATTRS
                           for old, new in carried.values())
    assert any(new.endswith("attn.dropout") for _, new in carried.values())
    assert changed and all(new == 0 and old > 0 and "dropout" in path for path, (old, new) in changed.items())
    assert "the known manual fix (transformer dropout 0, max_norm 1)" in text
