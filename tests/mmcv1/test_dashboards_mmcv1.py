"""MMCV 1.x's logging across a rollback (LogView): what the contract's IterBasedRunner does not reach, an
EpochBasedRunner whose rollback crosses the epoch boundary, where the loggers cleared the buffer in between."""
import glob
import json
import math
import os
import types

from harness import build_runner, run
from mmcv.runner import LogBuffer

from petr_stability.adapters.mmcv1_runner.dashboards import LogView


def strict(path):
    def refuse(name):
        raise ValueError(f"{path}: not strict JSON: {name}")

    return [json.loads(line, parse_constant=refuse) for line in open(path, encoding="utf-8") if line.strip()]


def view():
    runner = types.SimpleNamespace(log_buffer=LogBuffer(), hooks=[])
    return LogView(runner), runner.log_buffer


def test_a_rollback_within_the_epoch_keeps_what_the_restored_state_had():
    logs, buf = view()
    for loss in (1.0, 2.0):
        logs.mark()
        buf.update({"loss": loss, "time": 0.1})
    window = logs.window()  # a snapshot after iteration 2
    logs.mark()
    buf.update({"loss": math.nan, "grad_norm": math.nan, "time": 0.1})
    logs.rewind(window)
    assert buf.val_history["loss"] == [1.0, 2.0] and "grad_norm" not in buf.val_history
    assert len(buf.val_history["time"]) == 3  # the abandoned iteration's time was spent
    said = []
    logs.say_rewound(lambda msg, level: said.append(msg))
    assert len(said) == 1 and "loss: nan, grad_norm: nan" in said[0]
    buf.average(5)
    assert all(math.isfinite(v) for v in buf.output.values())


def test_a_rollback_across_an_epoch_boundary_takes_every_value_logged_since():
    logs, buf = view()
    for loss in (1.0, 2.0, 3.0):
        logs.mark()
        buf.update({"loss": loss})
    window = logs.window()  # a snapshot after iteration 3: its lengths count a buffer cleared since
    buf.clear()  # the next epoch starts (LoggerHook.before_epoch)
    logs.mark()
    buf.update({"loss": math.nan})
    logs.rewind(window)
    assert "loss" not in buf.val_history  # not kept up to the old length: all of it came after the snapshot


def test_epoch_runner_log_json_is_strict_across_an_epoch_boundary_rollback(tmp_path):
    # 8 iterations per epoch: snapshot at 5 (epoch 1), NaN weights at 10 (epoch 2) -> back to 5, rolled back alone
    # (issue 43: written between two steps), so max_norm stays.
    r = build_runner(str(tmp_path), runner="epoch", max_epochs=2, amp=dict(init_scale=64.0),
                     guard=dict(snapshot_interval=5, confirm_steps=3, check_interval=5),
                     faults=[dict(kind="weights", iters=[10], value="nan")])
    run(r)
    (path,) = glob.glob(os.path.join(str(tmp_path), "*.log.json"))
    lines = [line for line in strict(path) if line.get("mode") == "train"]
    assert lines and all(line["nan_guard/incidents"] in (0.0, 1.0) for line in lines)
    assert lines[-1]["nan_guard/incidents"] == 1.0 and lines[-1]["nan_guard/max_norm"] == 35.0
