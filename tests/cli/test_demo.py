"""``petr-stability demo --quick`` end to end: the table reports what each run measured."""
import json
import math

import pytest

from petr_stability.cli import main
from petr_stability.tools.demo import settings_for


def test_settings_validate():
    with pytest.raises(ValueError, match="--iters must be an integer >= 12, got 5"):
        settings_for(iters=5)
    s = settings_for(quick=True)
    assert s.burst_at <= s.iters
    # Two confirmed snapshots fit before the burst: the guard's settings are not tuned to it beyond that.
    assert s.guard["snapshot_interval"] * 2 + s.guard["confirm_steps"] < s.burst_at


def test_demo_quick_end_to_end(tmp_path, capsys):
    work = tmp_path / "demo"
    assert main(["demo", "--quick", "--work-dir", str(work)]) == 0
    out = capsys.readouterr().out
    summary = json.loads((work / "summary.json").read_text())
    runs = {r["key"]: r for r in summary["runs"]}
    assert set(runs) == {"a", "b", "c"}
    table = out[out.index("iters done"):]
    lines = [ln for ln in table.splitlines() if ln[:2] in ("a)", "b)", "c)")]
    assert len(lines) == 3
    for line, key in zip(lines, "abc"):
        r = runs[key]
        cols = line.split()
        assert f"{r['iters_done']}/{summary['settings']['iters']}" in cols
        assert ("yes" if r["params_finite"] else "NO") in cols
        assert f"{r['wall_s']:.1f}s" in cols
        assert r["steps"] >= r["iters_done"] > 0
        assert math.isfinite(r["final_loss"])
    # Unguarded runs never log incidents; the guarded one logs each in its work dir and the table agrees.
    assert runs["a"]["incidents"] == runs["b"]["incidents"] == 0
    incident_log = work / "c_guarded" / "nan_guard_incidents.jsonl"
    n = len(incident_log.read_text().splitlines()) if incident_log.exists() else 0
    assert runs["c"]["incidents"] == n
    assert (work / "demo.png").stat().st_size > 10_000
    assert "trigger" in out.lower() and "NanGuardHook(snapshot_interval=" in out
