"""The diagnosis on a real MMCV 1.x runner: the failing batch is re-run and the poisoned module named."""
from harness import build_runner, params_finite, run

from petr_stability import read_incidents

ATTN = "net.pts_bbox_head.layers.0.attentions.0.attn"
GUARD = dict(snapshot_interval=2, confirm_steps=2, check_interval=2)


def test_poisoned_attention_projection_is_named(tmp_path):
    wd = str(tmp_path)
    r = build_runner(wd, runner="iter", amp=dict(init_scale=512.0), max_iters=10, guard=GUARD,
                     faults=[dict(kind="weights", iters=[7], value="nan", param=f"{ATTN}.in_proj_weight")])
    run(r)
    assert r.iter == 10 and params_finite(r)
    (rec,) = read_incidents(wd)
    first = rec["diagnosis"]["first"]
    assert (first["module"], first["where"], first["detail"]) == (ATTN, "parameter", "in_proj_weight")
    assert rec["diagnosis"]["on_healthy_weights"]["reproduced"] is False
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in r.model.modules())
    assert hooks == 0


def test_diagnosis_off_records_none(tmp_path):
    wd = str(tmp_path)
    r = build_runner(wd, runner="iter", amp=dict(init_scale=512.0), max_iters=10, guard=dict(GUARD, diagnose=False),
                     faults=[dict(kind="weights", iters=[7], value="nan", param=f"{ATTN}.in_proj_weight")])
    run(r)
    (rec,) = read_incidents(wd)
    assert rec.get("diagnosis") is None and params_finite(r)
