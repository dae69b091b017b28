"""The guard in a plain-torch loop (TorchLoopIO and the driver) under torch's DistributedDataParallel: 2 CPU processes
(gloo), torchrun, one scenario per job; issue 41's replica check, end to end."""
import os

from launch import incident_logs, run_workers

from petr_stability import read_incidents

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common", "loop_worker.py")


def run(scenario, tmp_path):
    (r0, r1), _ = run_workers(WORKER, scenario, str(tmp_path))
    logs = incident_logs(str(tmp_path))
    return r0, r1, (read_incidents(logs[0]) if logs else [])


def test_a_finite_drift_on_one_rank_is_found_at_the_next_check_recorded_and_repaired(tmp_path):
    r0, r1, records = run("drift", tmp_path)
    assert (r0["error"], r1["error"]) == (None, None) and r0["iter"] == r1["iter"] == 18
    assert r0["replicas_on"] and r1["planted"] == [10]
    (rec,) = records
    assert rec["event"] == "replica_drift" and (rec["iteration"], rec["acted_at"]) == (12, 13)
    assert rec["drifted_ranks"] == [1] and rec["reference_rank"] == 0 and rec["repaired"] is True
    (row,) = rec["tensors"]
    assert (row["name"], row["rank"], row["elements"]) == (r0["first_param"], 1, 1)
    assert 5e-4 < row["max_abs_diff"] < 2e-3
    assert rec["actions"] == [{"target": "rank 1: model and optimizer state", "old": "its own copy (drifted)",
                               "new": "rank 0's copy"}]
    # Bit-identical from the repair on: parameters and optimizer state (BatchNorm statistics are rank-local).
    assert r0["digest"] == r1["digest"] and r0["optimizer_digest"] == r1["optimizer_digest"]
    assert r0["guard"]["replicas"] == r1["guard"]["replicas"]
    assert {k: r0["guard"]["replicas"][k] for k in ("checks", "drifts", "repairs", "last_clean")} == dict(
        checks=4, drifts=1, repairs=1, last_clean=16)
    line = next(x for x in r1["lines"] if "replicas drifted apart" in x)
    assert f"{r0['first_param']} on rank 1" in line and "rank 0's model and optimizer state sent to rank(s) 1" in line
    assert r0["guard"]["recoveries"] == 0  # a repair is no rollback


def test_nothing_planted_writes_no_record(tmp_path):
    r0, r1, records = run("clean", tmp_path)
    assert (r0["error"], r1["error"]) == (None, None) and records == []
    assert r0["digest"] == r1["digest"] and r0["guard"]["replicas"]["checks"] == 4
    assert not any("replica" in x for x in r0["lines"] + r1["lines"])


def test_nan_on_one_rank_is_left_to_the_divergence_path(tmp_path):
    r0, r1, records = run("nan", tmp_path)
    assert (r0["error"], r1["error"]) == (None, None) and r0["iter"] == 18
    assert [r["event"] for r in records] == ["divergence"] and records[0]["restored_from"]["source"] == "memory"
    assert r0["digest"] == r1["digest"] and r0["guard"]["replicas"]["drifts"] == 0
    # The check of iteration 12 saw the NaN on rank 1 and left it to the step's verdict (read one iteration later).
    assert any("rank(s) [1] hold non-finite values there: left to the divergence path" in x for x in r0["lines"])


def test_a_rank_that_keeps_drifting_stops_the_run_naming_it(tmp_path):
    r0, r1, records = run("keeps_drifting", tmp_path)
    assert r0["error_type"] == r1["error_type"] == "ReplicaDriftError" and r0["error"] == r1["error"]
    assert "rank(s) 1 drifted from the others' copy at 3 of the last 10 replica checks (iters 4, 8, 12)" in r0["error"]
    assert r0["error_ranks"] == [1] and r0["iter"] == r1["iter"] == 12
    assert [(r["event"], r["iteration"], r.get("repaired")) for r in records] == [
        ("replica_drift", 4, True), ("replica_drift", 8, True), ("replica_drift", 12, False), ("gave_up", 12, None)]


def test_a_check_of_the_last_iteration_is_read_as_the_run_ends(tmp_path):
    r0, r1, records = run("drift_at_the_end", tmp_path)
    (rec,) = records
    assert rec["iteration"] == 16 and "acted_at" not in rec and rec["repaired"] is True
    assert r0["digest"] == r1["digest"] and r0["optimizer_digest"] == r1["optimizer_digest"]
