"""report on MMEngine and MMCV 1.x work dirs: segments after rollbacks and resumes, global iterations, several
runs, damaged logs, diagnosis and skip lines, no matplotlib."""
import json
import os
import struct
import sys
import zlib
from html.parser import HTMLParser

import pytest

from petr_stability.cli import main
from petr_stability.core.records import read_records as read_json_records
from petr_stability.reporting import find_runs, read_scalars, summarize

DIAGNOSIS = {"first": {"module": "head.transformer.decoder.layers.0.attentions.0", "type": "MultiheadAttention",
                       "where": "output", "detail": "", "phase": "forward", "value": "nan",
                       "why": "its inputs were finite, its output is not"},
             "nonfinite_parameters": ["head.fc.weight"], "over_fp16": [], "seconds": 0.1,
             "on_healthy_weights": {"weights": "snapshot of iter 19", "reproduced": False, "first": None,
                                    "over_fp16": [], "backward": "run", "seconds": 0.1}}
INCIDENTS = [
    dict(event="divergence", iteration=30, reason="non-finite weights", verdict="DIVERGED",
         signals=dict(grad_norm="nan", loss=2.5, loss_scale=128.0, scale_mode="dynamic"),
         actions=[dict(target="optim_wrapper.clip_grad.max_norm", old=35, new=1.0),
                  dict(target="net.head.layers.0.attentions.0.attn.dropout", old=0.1, new=0.0)],
         restored_from=dict(source="memory", iteration=20), iterations_lost=10, recoveries=0, diagnosis=DIAGNOSIS,
         cause=dict(cause="dynamics", evidence="the same batch trains fine on the healthy weights",
                    action="next rung of the ladder")),
    dict(event="divergence", iteration=25, reason="dynamic loss scale fell to 0.5", verdict="DIVERGED",
         signals=dict(grad_norm="inf", loss=2.4, loss_scale=0.5), actions=[],
         restored_from=dict(source="memory", iteration=10), iterations_lost=15, recoveries=1),
    dict(event="skip", iteration=33, reason="non-finite gradient in fp32", signals=dict(grad_norm="nan")),
]


def _write_incidents(work_dir, extra=""):
    with open(os.path.join(work_dir, "nan_guard_incidents.jsonl"), "w") as f:
        for rec in INCIDENTS:
            f.write(json.dumps(rec) + "\n")
        f.write(extra)


def _scalars(work_dir, stamp, iters, max_norm=35.0):
    vis = os.path.join(work_dir, stamp, "vis_data")
    os.makedirs(vis, exist_ok=True)
    with open(os.path.join(vis, "scalars.json"), "a") as f:
        for it in iters:
            f.write(json.dumps({"lr": 2e-4, "loss": 2.0 + 1 / it, "grad_norm": float("nan") if it == 30 else 3.0,
                                "nan_guard/max_norm": max_norm, "nan_guard/loss_scale": 256.0,
                                "iter": it, "step": it}) + "\n")


def test_mmengine_rolled_back_run(tmp_path, capsys):
    # the counter went 5..30, rolled back to 20 and replayed 25..30, rolled back to 10 and went on to 45
    _scalars(str(tmp_path), "20260101_000000", [5, 10, 15, 20, 25, 30])
    _scalars(str(tmp_path), "20260101_000000", [25, 30], max_norm=1.0)
    _scalars(str(tmp_path), "20260101_000000", [15, 20, 25, 30, 35, 40], max_norm=1.0)
    with open(tmp_path / "20260101_000000" / "vis_data" / "scalars.json", "a") as f:
        f.write('{"loss": Infinity, "grad_norm": "inf", "iter": 45, "step": 45}\n')
        f.write('{"coco/bbox_mAP": 0.1, "step": 45}\n')  # a validation line: not a training row, not a problem
    _write_incidents(str(tmp_path))
    (run,) = find_runs(str(tmp_path))
    rows, problems, _ = read_scalars(run)
    assert problems == []
    assert [r["iter"] for r in rows] == [5, 10, 15, 20, 25, 30, 25, 30, 15, 20, 25, 30, 35, 40, 45]  # file order
    assert [int(r["segment"]) for r in rows] == [0] * 6 + [1] * 2 + [2] * 7
    out = tmp_path / "timeline.png"
    assert main(["report", str(tmp_path), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "incidents: 2" in text
    assert "iterations lost: 25" in text
    assert "current max_norm: 1" in text
    assert "1 transformer dropout(s) set to 0" in text
    assert "optim_wrapper.clip_grad.max_norm: 35 -> 1" in text
    assert "rolled back to iter 20 (memory)" in text
    assert "non-finite loss/grad_norm values in them: 5" in text  # iter 30 three times, iter 45 twice
    assert "in 3 segment(s)" in text
    # the diagnosis line of the incident, and the fp32 skip
    assert ("diagnosis: first non-finite value in head.transformer.decoder.layers.0.attentions.0 "
            "(MultiheadAttention, output, forward)") in text
    assert "on the healthy weights (snapshot of iter 19) the batch stays finite" in text
    assert ("cause: dynamics: the same batch trains fine on the healthy weights; action: next rung of the ladder"
            in text)
    assert "fp32 steps skipped by the guard: 1" in text and "iter 33: non-finite gradient in fp32" in text
    assert out.stat().st_size > 10_000


def test_resumed_run_over_timestamp_dirs(tmp_path):
    # written in this order; the second dir's name sorts later, as MMEngine's timestamps do
    _scalars(str(tmp_path), "20260101_120000", [5, 10, 15])
    _scalars(str(tmp_path), "20260102_080000", [10, 15, 20])  # resumed from iter 5's checkpoint
    (run,) = find_runs(str(tmp_path))
    assert [os.path.basename(os.path.dirname(os.path.dirname(p))) for p in run.mmengine] == [
        "20260101_120000", "20260102_080000"]
    rows, _, _ = read_scalars(run)
    assert [(r["iter"], int(r["segment"])) for r in rows] == [(5, 0), (10, 0), (15, 0), (10, 1), (15, 1), (20, 1)]


def _mmcv1_log(path, lines, config=None):
    with open(path, "w") as f:
        f.write(json.dumps({"env_info": "x", "config": config} if config else {}) + "\n")
        for epoch, it in lines:
            f.write(json.dumps({"mode": "train", "epoch": epoch, "iter": it, "lr": 2e-4, "loss": 1.0,
                                "grad_norm": 5.0}) + "\n")
        f.write(json.dumps({"mode": "val", "epoch": 1, "iter": 10, "mAP": 0.3}) + "\n")


def test_mmcv1_iter_based_runner_iter_is_global(tmp_path):
    # A real MMCV 1.x IterBasedRunner log (TextLoggerHook, interval 5, 11 iterations per loader pass): `iter` is
    # global, `epoch` counts loader passes. Read as epoch-relative, this 12-iteration run became [5, 10, 16].
    _mmcv1_log(tmp_path / "20260101_000000.log.json", [(1, 5), (1, 10), (2, 15), (2, 20), (3, 25)])
    rows, _, how = read_scalars(find_runs(str(tmp_path))[0])
    assert [r["iter"] for r in rows] == [5, 10, 15, 20, 25]
    assert "global iter" in how
    # the runner type in the config text MMCV 1.x dumps first decides when the log alone cannot
    _mmcv1_log(tmp_path / "20260101_000000.log.json", [(1, 5), (1, 10)],
               config="runner = dict(type='IterBasedRunner', max_iters=12)\n")
    rows, _, how = read_scalars(find_runs(str(tmp_path))[0])
    assert [r["iter"] for r in rows] == [5, 10] and "IterBasedRunner" in how


def test_mmcv1_epoch_based_offset_is_the_epoch_length(tmp_path):
    # 11 iterations per epoch, logged every 5: the last logged inner iter (10) is not the epoch's length
    log = tmp_path / "20260101_000000.log.json"
    _mmcv1_log(log, [(1, 5), (1, 10), (2, 5), (2, 10), (3, 5)])
    rows, _, how = read_scalars(find_runs(str(tmp_path))[0])
    assert [r["iter"] for r in rows] == [5, 10, 15, 20, 25]  # estimated with length 10, and it says so
    assert "largest iter logged" in how
    with open(tmp_path / "20260101_000000.log", "w") as f:  # the text log states len(data_loader)
        f.write("2026-01-01 00:00:01,000 - mmdet - INFO - Epoch [1][5/11]\tlr: 2.000e-04\n")
    rows, _, how = read_scalars(find_runs(str(tmp_path))[0])
    assert [r["iter"] for r in rows] == [5, 10, 16, 21, 27]
    assert "epoch length 11 from the text log" in how
    _, numbers = summarize([], rows)
    assert numbers["incidents"] == 0 and numbers["max_norm"] is None and numbers["segments"] == 1


def test_parent_of_several_runs_reports_each(tmp_path, capsys):
    for name in ("a_default", "c_guarded"):
        _scalars(str(tmp_path / name), "20260101_000000", [5, 10])
    _write_incidents(str(tmp_path / "c_guarded"))
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "holds 2 runs" in out
    assert f"work dir: {tmp_path / 'a_default'}" in out and f"work dir: {tmp_path / 'c_guarded'}" in out
    assert out.count("incidents: 0") == 1 and out.count("incidents: 2") == 1  # never merged
    assert (tmp_path / "a_default" / "nan_guard_report.png").exists()
    assert (tmp_path / "c_guarded" / "nan_guard_report.png").exists()
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "one.png")]) == 2  # a usage error
    assert "2 runs" in capsys.readouterr().err


def test_the_jsonl_file_itself(tmp_path, capsys):
    _write_incidents(str(tmp_path))
    _scalars(str(tmp_path), "20260101_000000", [5, 10])
    assert main(["report", str(tmp_path / "nan_guard_incidents.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "incidents: 2" in out and "log lines: 2" in out


def test_damaged_logs_are_named_and_counted(tmp_path, capsys):
    _write_incidents(str(tmp_path), extra='[1, 2]\n{"iteration": 40}\n\xff\n{"event": "diverg')
    with open(tmp_path / "nan_guard_incidents.jsonl", "r+b") as f:
        data = f.read().replace("\xff".encode(), b"\xff\xfe")
        f.seek(0)
        f.write(data)
        f.truncate()
    _scalars(str(tmp_path), "20260101_000000", [5, 10])
    with open(tmp_path / "20260101_000000" / "vis_data" / "scalars.json", "a") as f:
        f.write('{"loss": 1.0, "it')  # torn in the middle of the file
        f.write('\n{"loss": 1.0, "iter": 15, "step": 15}\n')
    path = str(tmp_path / "nan_guard_incidents.jsonl")
    records, problems = read_json_records(path, required=("event", "iteration"))
    assert [p.line for p in problems] == [4, 5, 6, 7]
    assert "not an object" in problems[0].what and "'event'" in problems[1].what
    assert "UTF-8" in problems[2].what and "torn" in problems[3].what
    assert main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    for line in (4, 5, 6, 7):
        assert f"{path}:{line}:" in captured.err
    assert "scalars.json:3: not valid JSON" in captured.err
    assert "4 incident record(s) could not be read" in captured.out
    assert "incidents: >= 2" in captured.out and "iterations lost: >= 25" in captured.out
    assert "unreadable training-log lines: 1" in captured.out
    assert "log lines: 3" in captured.out


def test_without_matplotlib(tmp_path, capsys, monkeypatch):
    _write_incidents(str(tmp_path))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "incidents: 2" in captured.out
    assert captured.out.strip().splitlines()[-2].startswith("timeline: not drawn, matplotlib is not installed")
    assert captured.out.strip().splitlines()[-1] == f"page: {tmp_path / 'nan_guard_report.html'}"
    assert "Traceback" not in captured.err
    assert not (tmp_path / "nan_guard_report.png").exists()


def test_errors(tmp_path, capsys):
    # nothing to report on: the command failed (1); a file that is no run's log: a usage error (2)
    assert main(["report", str(tmp_path / "none")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 1
    assert "no nan_guard_incidents.jsonl" in capsys.readouterr().err
    other = tmp_path / "notes.txt"
    other.write_text("x")
    assert main(["report", str(other)]) == 2
    assert "notes.txt" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ['{"event": "divergence", "iteration": "30"}'])
def test_record_with_a_bad_field_is_a_problem(tmp_path, bad):
    (tmp_path / "nan_guard_incidents.jsonl").write_text(bad + "\n")
    from petr_stability.reporting import read_incident_records
    records, problems = read_incident_records(find_runs(str(tmp_path))[0])
    assert records == [] and "not an integer" in problems[0].what


# ------------------------------------------------------------------ the picture and the page, read back
def _png_chunks(path):
    """(width, height, {tEXt key: text}) of a PNG file."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, texts, size = 8, {}, None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind in (b"tEXt", b"zTXt", b"iTXt"):
            key, _, value = body.partition(b"\0")
            if kind == b"zTXt":
                value = zlib.decompress(value[1:])
            elif kind == b"iTXt":
                value = value[2:].split(b"\0", 2)[2]
            texts[key.decode("latin-1")] = value.decode("utf-8" if kind == b"iTXt" else "latin-1")
        pos += 12 + length
    return size[0], size[1], texts


class _Page(HTMLParser):
    """The page's title, image and table cells as text (entities decoded)."""

    def __init__(self):
        super().__init__()
        self.title, self.images, self.rows, self.code = "", [], [], []
        self._in = None

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        elif tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th", "title", "code"):
            self._in = tag
            if tag in ("td", "th"):
                self.rows[-1].append("")
            elif tag == "code":
                self.code.append("")

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in in ("td", "th"):
            self.rows[-1][-1] += data
        elif self._in == "title":
            self.title += data
        elif self._in == "code":
            self.code[-1] += data


def _read_page(path):
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _fp32_scalars(work_dir, iters):
    vis = os.path.join(work_dir, "20260101_000000", "vis_data")
    os.makedirs(vis, exist_ok=True)
    with open(os.path.join(vis, "scalars.json"), "a") as f:
        for it in iters:
            f.write(json.dumps({"loss": 1.0 / it, "grad_norm": 2.0, "nan_guard/max_norm": 35.0, "iter": it}) + "\n")


HOSTILE = '<script>alert("x")</script> & <b>bold</b>'


def test_the_picture_has_a_title_labels_at_each_incident_and_only_the_logged_panels(tmp_path, capsys):
    from petr_stability.reporting import incident_label, timeline_figure

    _scalars(str(tmp_path), "20260101_000000", [5, 10, 15, 20, 25, 30, 35, 40])  # fp16: loss_scale logged
    _write_incidents(str(tmp_path))
    (tmp_path / "nan_guard_patched_config.py").write_text(
        "# Written by petr_stability from /work/projects/configs/petr_vov.py\n_base_ = []\n")
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "config: /work/projects/configs/petr_vov.py" in out
    width, height, texts = _png_chunks(tmp_path / "nan_guard_report.png")
    assert texts["Title"] == f"/work/projects/configs/petr_vov.py; work dir: {tmp_path}"
    labels = texts["Description"].splitlines()
    assert labels == ["#1 dynamics: max_norm 35 -> 1; dropout 0.1 -> 0; rolled back to iter 20 (memory)",
                      "#2 divergence: rolled back to iter 10 (memory)"]
    many = dict(INCIDENTS[0], actions=[dict(target=f"head.layers.{i}.attn.dropout", old=0.1, new=0) for i in range(12)])
    assert incident_label(3, many) == "#3 dynamics: dropout 0.1 -> 0 (x12); rolled back to iter 20 (memory)"
    fig = timeline_figure(*_rows_and_records(tmp_path), title="T")
    strip, *panels = fig.axes
    assert [ax.get_ylabel() for ax in panels] == ["loss", "grad_norm", "loss scale", "max_norm"]
    drawn = {t.get_text().strip(): t.get_position()[0] for t in strip.texts}
    assert drawn == {labels[0]: 30, labels[1]: 25}  # each at its incident's iteration
    assert fig._suptitle.get_text() == "T"

    fp32 = tmp_path / "fp32"
    _fp32_scalars(str(fp32), [5, 10, 15])
    assert main(["report", str(fp32)]) == 0
    assert "config: unknown" in capsys.readouterr().out
    fig = timeline_figure(*_rows_and_records(fp32))
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "grad_norm", "max_norm"]  # no empty loss-scale panel
    assert not any(ax.texts for ax in fig.axes)  # and no incident strip: the run had none
    _, fp32_height, _ = _png_chunks(fp32 / "nan_guard_report.png")
    assert fp32_height < height


def _rows_and_records(work_dir):
    from petr_stability.reporting import read_incident_records

    (run,) = find_runs(str(work_dir))
    return read_scalars(run)[0], read_incident_records(run)[0]


def test_the_page_holds_the_incident_table_with_every_value_escaped(tmp_path, capsys):
    records = [dict(INCIDENTS[0], reason=HOSTILE, cause=dict(INCIDENTS[0]["cause"], evidence=HOSTILE)),
               INCIDENTS[1], INCIDENTS[2]]
    with open(tmp_path / "nan_guard_incidents.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    (tmp_path / "my <cfg> & co.py").write_text("model = dict()\n")  # the runner's copy names the config
    _scalars(str(tmp_path), "20260101_000000", [5, 10, 30])
    out = tmp_path / "pics" / "timeline.png"
    out.parent.mkdir()
    assert main(["report", str(tmp_path), "-o", str(out)]) == 0
    assert f"page: {tmp_path / 'pics' / 'timeline.html'}" in capsys.readouterr().out
    raw = (tmp_path / "pics" / "timeline.html").read_text(encoding="utf-8")
    assert "<script>" not in raw and "<b>bold" not in raw
    page = _read_page(tmp_path / "pics" / "timeline.html")
    assert page.title == "petr-stability report: my <cfg> & co.py (the runner's copy in the work dir)"
    assert page.code == ["my <cfg> & co.py (the runner's copy in the work dir)", str(tmp_path)]
    assert page.images == ["timeline.png"]  # beside the page
    header, *rows = page.rows
    assert header[:5] == ["#", "iteration", "event", "reason", "cause"]
    assert len(rows) == 2  # the fp32 skip is a dotted line and a summary line, not a numbered incident
    first = dict(zip(header, rows[0]))
    assert first["#"] == "1" and first["iteration"] == "30" and first["reason"] == HOSTILE
    assert first["evidence"] == HOSTILE and first["cause"] == "dynamics"
    assert first["settings changed"] == ("optim_wrapper.clip_grad.max_norm: 35 -> 1; "
                                         "net.head.layers.0.attentions.0.attn.dropout: 0.1 -> 0")
    assert first["rolled back to"] == "iter 20 (memory)" and first["iterations lost"] == "10"
    assert first["diagnosis"].startswith("first non-finite value in head.transformer.decoder.layers.0.attentions.0")
    second = dict(zip(header, rows[1]))
    assert (second["#"], second["iteration"], second["cause"]) == ("2", "25", "")


#: The examples' bad-sample run's record as the guard writes it (examples/mmengine/train.py --bad-sample 10), trimmed.
QUARANTINED = dict(
    event="divergence", iteration=8, reason="non-finite weights, buffers or optimizer state", epoch=0,
    actions=[dict(target="quarantine.samples", old=0, new=1)], restored_from=dict(iteration=1, source="memory"),
    iterations_lost=7, samples=[dict(sample_idx=10, index=10, evidence="its own values are non-finite")],
    cause=dict(cause="data", action="quarantine the batch's samples", signals=dict(
        quarantined=[dict(sample_idx=10, index=10, token="e93e98b63d3b40209056d129dc53ceee")])))


def test_the_report_names_the_samples_it_quarantined_not_only_a_count():
    text, _ = summarize([QUARANTINED], [])
    assert "    quarantined: index 10 (sample_idx 10, token e93e98b63d3b40209056d129dc53ceee)" in text.splitlines()
    from petr_stability.reporting import incident_label

    assert incident_label(1, QUARANTINED) == "#1 data: quarantined index 10; rolled back to iter 1 (memory)"
    two = dict(QUARANTINED, cause=dict(QUARANTINED["cause"], signals=dict(quarantined=[dict(index=3), dict(index=4)])))
    assert incident_label(2, two) == "#2 data: quarantined index 3, 4; rolled back to iter 1 (memory)"
