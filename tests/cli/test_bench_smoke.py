"""benchmarks/bench.py runs end to end on the CPU at its smallest setting (the GPU check runs it on CUDA)."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "..", "benchmarks", "bench.py")


def test_bench_runs_and_writes_every_measured_ratio(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--size", "small", "--rounds", "1", "--block",
                           "2", "--json", str(out)], capture_output=True, text=True,
                          timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))  # a hang guard, not a limit
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["rollback"]["restore_vs_raw_copy"] > 0 and res["snapshot"]["snapshot_bytes"] > 0
