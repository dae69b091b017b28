"""report on synthetic MMEngine and MMCV 1.x work dirs: summary numbers, PNG written, NaN/Inf in logs."""
import json
import os

from petr_stability.cli import main
from petr_stability.tools.report import find_logs, read_scalars, summarize

INCIDENTS = [
    dict(event="divergence", iteration=30, reason="non-finite weights", verdict="DIVERGED",
         signals=dict(grad_norm="nan", loss=2.5, loss_scale=128.0, scale_mode="dynamic"),
         actions=[dict(target="optim_wrapper.clip_grad.max_norm", old=35, new=1.0),
                  dict(target="net.head.layers.0.attentions.0.attn.dropout", old=0.1, new=0.0)],
         restored_from=dict(source="memory", iteration=19), iterations_lost=10, recoveries=0),
    dict(event="divergence", iteration=25, reason="dynamic loss scale fell to 0.5", verdict="DIVERGED",
         signals=dict(grad_norm="inf", loss=2.4, loss_scale=0.5), actions=[],
         restored_from=dict(source="memory", iteration=9), iterations_lost=15, recoveries=1),
]


def _write_incidents(work_dir):
    with open(os.path.join(work_dir, "nan_guard_incidents.jsonl"), "w") as f:
        for rec in INCIDENTS:
            f.write(json.dumps(rec) + "\n")
        f.write('{"event": "diverg')  # a torn last line


def test_mmengine_work_dir(tmp_path, capsys):
    vis = tmp_path / "20260101_000000" / "vis_data"
    vis.mkdir(parents=True)
    with open(vis / "scalars.json", "w") as f:
        for it in range(5, 45, 5):
            rec = {"lr": 2e-4, "loss": 2.0 + 1 / it, "grad_norm": float("nan") if it == 30 else 3.0,
                   "nan_guard/max_norm": 35.0 if it < 30 else 1.0, "nan_guard/loss_scale": 256.0,
                   "iter": it, "step": it}
            f.write(json.dumps(rec) + "\n")  # json writes NaN as NaN
        f.write('{"loss": Infinity, "grad_norm": "inf", "iter": 45, "step": 45}\n')
    _write_incidents(str(tmp_path))
    out = tmp_path / "timeline.png"
    assert main(["report", str(tmp_path), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "incidents: 2" in text
    assert "iterations lost: 25" in text
    assert "current max_norm: 1" in text
    assert "1 transformer dropout(s) set to 0" in text
    assert "optim_wrapper.clip_grad.max_norm: 35 -> 1" in text
    assert "non-finite loss/grad_norm values in them: 3" in text
    assert out.stat().st_size > 10_000


def test_summary_numbers_without_guard(tmp_path):
    logs = tmp_path / "run"
    logs.mkdir()
    with open(logs / "20260101_000000.log.json", "w") as f:
        f.write(json.dumps({"env_info": "x", "config": "y"}) + "\n")
        for epoch in (1, 2):
            for it in (50, 100):
                f.write(json.dumps({"mode": "train", "epoch": epoch, "iter": it, "lr": 2e-4,
                                    "loss": 1.0, "grad_norm": "NaN" if epoch == 2 else 5.0}) + "\n")
            f.write(json.dumps({"mode": "val", "epoch": epoch, "iter": 10, "mAP": 0.3}) + "\n")
    paths = find_logs(str(tmp_path))
    rows = read_scalars(paths)
    assert [r["iter"] for r in rows] == [50, 100, 150, 200]
    _, numbers = summarize([], rows)
    assert numbers["incidents"] == 0
    assert numbers["iterations_lost"] == 0
    assert numbers["max_norm"] is None
    assert numbers["nonfinite_log_values"] == 2
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "nan_guard_report.png").exists()


def test_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no nan_guard_incidents.jsonl" in capsys.readouterr().err
