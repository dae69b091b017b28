"""The agreement scenarios both runner families must pass; each family's test module subclasses with its worker."""
import os
from typing import Any, Dict, List, Tuple

import pytest
import torch
from launch import check_agreement, incident_logs, run_agreeing, run_failing, run_workers

from petr_stability import read_incidents
from petr_stability.adapters.mmengine_runner.checkpoints import load_mmengine_checkpoint as safe_load

__all__ = ["AgreementScenarios", "OLDER_CHECKPOINT", "incidents", "quarantined", "weights_digest"]

#: The file an older guarded run left in a scenario's work dir, at an iteration the scenario never reaches.
OLDER_CHECKPOINT = "iter_40.pth"
#: What stops corrupt_rank1_static in both families today.
#: Records of decisions (the incident log also holds per-step events: fp32 skips, non-finite losses, ...).
DECISIONS = ("divergence", "stalled", "gave_up")


def incidents(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The records of the guard's decisions, in order."""
    return [r for r in records if r["event"] in DECISIONS]


def quarantined(result: Dict[str, Any]) -> List[int]:
    """The dataset indices a rank's guard holds in its quarantine at the end of the run, sorted."""
    return sorted(int(i) for i in result["guard"]["remedies"]["quarantine"]["skip"]["indices"])


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of the parameters, to compare final weights across ranks.

    Parameters only: DDP broadcasts buffers from rank 0 at the start of each forward, so BatchNorm statistics
    differ between ranks by the last batch after any forward; that is DDP, not the guard.
    """
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class AgreementScenarios:
    """Runs each scenario of ``worker`` under torchrun (2 gloo processes) and checks the ranks agreed."""

    worker = ""
    #: scenario -> why it fails today: a bug in petr_stability this family's run exposes (strict xfail).
    known_bugs: Dict[str, str] = {}

    def expect_bug(self, request: Any, scenario: str) -> None:
        if scenario in self.known_bugs:
            request.node.add_marker(pytest.mark.xfail(strict=True, reason=self.known_bugs[scenario]))

    def run(self, scenario: str, tmp_path: Any) -> Tuple[Dict[str, Any], Dict[str, Any], List[Dict]]:
        return run_agreeing(self.worker, scenario, str(tmp_path))

    def test_weights_poisoned_on_one_rank_roll_back_everywhere(self, tmp_path: Any) -> None:
        r0, r1, records = self.run("weights_one_rank", tmp_path)
        rec, second = incidents(records)
        assert r0["error"] is None and r0["iter"] == 18
        for r in (rec, second):
            assert r["event"] == "divergence" and r["world_size"] == 2
            # Rank 0 (which writes the log) saw nothing wrong itself: the verdict came from rank 1.
            assert r["reason"].startswith("another rank reported DIVERGED")
            assert r["restored_from"]["source"] == "memory"
        # The verdict of one rank: the NaN was written between two steps (rank 1's replay), the first divergence is
        # rolled back alone on every rank, as on one; the second gets the known manual fix on every rank.
        assert rec["cause"]["signals"].get("rollback_alone") is True and rec["actions"] == []
        assert r0["guard"]["recoveries"] == 2 and r0["max_norm"] == r1["max_norm"] == 1.0

    def test_loss_nan_on_one_rank_fp32(self, tmp_path: Any) -> None:
        r0, r1, records = self.run("loss_one_rank", tmp_path)
        assert r0["error"] is None and r0["iter"] == 18
        assert [r["event"] for r in incidents(records)] == ["divergence"]
        # fp32 has no loss scaler: every skipped step is an event of its own (rank 0 writes the log; its gradients
        # went non-finite through the all-reduce).
        skips = [r for r in records if r["event"] == "skip"]
        assert skips and all(r["signals"]["step_applied"] is False for r in skips)
        assert r0["guard"]["skipped_steps"] >= len(skips)

    def test_weights_poisoned_on_all_ranks_with_one_snapshot_copy_per_node(self, tmp_path: Any) -> None:
        r0, r1, records = self.run("weights_all_ranks", tmp_path)
        (rec,) = incidents(records)
        assert r0["error"] is None and r0["iter"] == 18
        assert rec["restored_from"]["source"] == "memory"
        # snapshot_copies='node': rank 0 holds the tensors, rank 1 only the structure (and got them on restore).
        assert r0["snapshot_bytes"] > 0 and r1["snapshot_bytes"] == 0
        assert r0["snapshots"] == r1["snapshots"]

    def test_endless_divergence_stops_every_rank_with_the_same_error(self, tmp_path: Any) -> None:
        r0, r1, records = self.run("endless", tmp_path)
        assert r0["error_type"] == "NanGuardGaveUp"
        assert "recovery budget is spent" in r0["error"]
        assert [r["event"] for r in incidents(records)] == ["divergence", "gave_up"]

    def test_disk_restore_without_a_shared_filesystem(self, tmp_path: Any) -> None:
        r0, r1, records = self.run("disk_no_shared_fs", tmp_path)
        assert r0["error"] is None and r0["iter"] == 8
        # The restore order: the start state (no snapshot while the scale calibrates), then the disk. Only rank 0's
        # work dir has checkpoints; rank 1 received the state from it.
        assert [r["restored_from"] for r in incidents(records)] == [
            {"source": "start", "iteration": 0},
            {"source": os.path.join(str(tmp_path), "work_rank0", "iter_4.pth"), "iteration": 4}]
        rank1_dir = tmp_path / "work_rank1"
        assert not list(rank1_dir.rglob("*.pth")) and not list(rank1_dir.rglob("*.jsonl"))

    @pytest.mark.parametrize("scenario", ["corrupt_rank1_static", "corrupt_rank1_static_no_replay",
                                          "corrupt_rank1_dynamic_no_replay", "corrupt_rank1_fp32_no_replay"])
    def test_nonfinite_loss_on_one_rank_for_six_steps_before_anything_is_confirmed(self, tmp_path: Any, request: Any,
                                                                                  scenario: str) -> None:
        # issue 13: this used to stop with NoHealthyStateError (both families) while the run's own start state was
        # healthy. Rank 1 reads corrupt samples in 6 consecutive steps; the data moves on through rollbacks.
        self.expect_bug(request, scenario)
        (r0, r1), log = run_workers(self.worker, scenario, str(tmp_path))
        assert (r0["error_type"], r0["error"]) == (None, None), r0["error"]
        records = check_agreement(r0, r1, str(tmp_path))  # the same weights on both ranks, the same decisions
        assert r0["iter"] == 18
        decisions = incidents(records)
        assert decisions and all(r["event"] == "divergence" for r in decisions)
        assert r0["guard"]["recoveries"] == len(decisions)
        # Never another run's file: the older run's later checkpoint stays where it is, unused; a file restored
        # from carries this run's id.
        older = os.path.join(str(tmp_path), "work", OLDER_CHECKPOINT)
        assert os.path.isfile(older)
        for rec in decisions:
            if rec["restored_from"] is None:  # bad data on a state checked finite everywhere: skipped, no rollback
                assert rec["cause"]["cause"] == "data" and rec["iterations_lost"] == 0
                continue
            source = rec["restored_from"]["source"]
            assert rec["restored_from"]["iteration"] < rec["iteration"]
            if source not in ("memory", "start"):
                ckpt = safe_load(source)
                state = ckpt.get("nan_guard") or ckpt["meta"]["nan_guard"]  # MMEngine / MMCV 1.x
                assert state["run_id"] == r0["guard"]["run_id"] != "an-older-run", source

    @pytest.mark.parametrize("scenario", ["bad_box_rank1_fp32", "bad_box_rank1_dynamic"])
    def test_a_bad_sample_on_one_rank_is_quarantined_alone_and_the_run_finishes(self, tmp_path: Any,
                                                                             scenario: str) -> None:
        # issue 21: rank 0's clean batch used to be named with rank 1's (its all-reduced gradient was NaN too), the
        # quarantine passed its bound and the run stopped as structural.
        from worker_common import BAD_BOX

        r0, r1, records = self.run(scenario, tmp_path)  # the same weights and decisions on both ranks
        assert r0["error"] is None and r0["iter"] == r1["iter"] > 0
        assert not incidents(records)  # no rollback, no stop
        recurring = [r for r in records if r["event"] == "recurring_sample"]
        assert len(recurring) == 1 and recurring[0]["quarantined"]
        assert recurring[0]["batch"] == [{"index": BAD_BOX, "rank": 1}]  # rank 1's bad sample, alone
        assert quarantined(r0) == quarantined(r1) == [BAD_BOX]
        if "fp32" in scenario:  # every skip names rank 1's sample only
            skips = [r for r in records if r["event"] == "skip"]
            assert len(skips) == 2 and all(r["batch"] == [{"index": BAD_BOX, "rank": 1}] for r in skips)

    def test_bad_pixels_on_one_rank_quarantine_that_sample_alone_within_a_realistic_bound(self, tmp_path: Any) -> None:
        # issue 21: the four ids of both ranks' batches used to pass the bound and stop the run as structural.
        from worker_common import BAD_BOX

        r0, r1, records = self.run("bad_pixels_rank1_large", tmp_path)
        assert r0["error"] is None and r0["iter"] == 24
        (rec,) = incidents(records)
        assert rec["event"] == "divergence" and rec["cause"]["cause"] == "data"
        assert rec["cause"]["ranks"] == {"1": "data"} or rec["cause"]["ranks"]["1"] == "data"
        assert rec["cause"]["signals"]["quarantined"] == [{"index": BAD_BOX, "rank": 1}]
        assert quarantined(r0) == [BAD_BOX]

    def test_a_bright_frame_on_one_rank_gets_the_verdict_it_gets_on_one_rank(self, tmp_path: Any) -> None:
        # issue 43 item 4: on 2 ranks a bright but finite frame was classed data where 1 rank put a module in fp32;
        # one kind of evidence, one verdict. The same scenario on 1 rank (which then reads every sample) and on 2.
        from worker_common import BAD_BOX

        r0, r1, records = self.run("bright_rank1_dynamic", os.path.join(str(tmp_path), "two"))
        (alone,), _ = run_workers(self.worker, "bright_rank1_dynamic", os.path.join(str(tmp_path), "one"), nproc=1)
        one_rank = read_incidents(incident_logs(os.path.join(str(tmp_path), "one"))[0])
        for result, log in ((r0, records), (alone, one_rank)):
            assert result["error"] is None and result["finite"] and result["iter"] == 48
            remedies = result["guard"]["remedies"]
            assert quarantined(result) == [BAD_BOX]
            assert not remedies["fp32"]["fp32"], remedies["fp32"]  # no module in fp32
            assert remedies["lr"]["lr_factor"] == 1.0, remedies["lr"]  # no rate change
            decided = incidents(log) + [r for r in log if r["event"] == "recurring_sample"]
            assert decided, "the bright frame broke no step"
            for rec in decided:
                assert rec["event"] != "gave_up"
                assert rec["event"] == "recurring_sample" or rec["cause"]["cause"] == "data", rec.get("cause")
        assert quarantined(r1) == [BAD_BOX]

    def test_a_slow_rank_s_fault_is_recovered_on_both_ranks_one_iteration_later(self, tmp_path: Any) -> None:
        # issue 35: rank 1 sleeps 50 ms after every optimizer step, before the guard, and its weights turn NaN in
        # iteration 12. Every healthy step's verdict is agreed during the next iteration (rank 0 never waits for rank 1
        # inside the guard), snapshot steps at once; both act on iteration 12's verdict in iteration 13.
        r0, r1, records = self.run("slow_rank1", tmp_path)
        (rec,) = incidents(records)
        assert r0["error"] is None and r0["iter"] == 18
        assert rec["reason"].startswith("another rank reported DIVERGED")
        assert rec["acted_at"] == rec["iteration"] + 1
        assert rec["iterations_lost"] == rec["acted_at"] - rec["restored_from"]["iteration"]
        # The same steps agreed one iteration later on both ranks (the others: the loss scale's calibration while no
        # snapshot exists yet, snapshot steps, checkpoint saves and the run's end).
        assert r0["agreement"] == r1["agreement"] and r0["agreement"]["deferred"] >= 5

    def test_a_finite_drift_on_one_rank_is_found_at_the_next_check_recorded_and_repaired(self, tmp_path: Any) -> None:
        # issue 41: +1e-3 on one weight of rank 1 after its step of iteration 10 (no NaN anywhere). The replicas are
        # compared every 4 iterations: the check of iteration 12, read at 13, names rank 1 and the tensor, rank 0's
        # model and optimizer state go to rank 1, and the run finishes with both ranks bit-identical.
        r0, r1, records = self.run("drift_rank1", tmp_path)  # the same parameters on both ranks at the end
        assert (r0["error"], r1["error"]) == (None, None) and r0["iter"] == r1["iter"] == 18
        assert not incidents(records)  # no divergence, no rollback
        (rec,) = [r for r in records if r["event"] == "replica_drift"]
        assert (rec["iteration"], rec["acted_at"], rec["world_size"]) == (12, 13, 2)
        assert rec["drifted_ranks"] == [1] and rec["reference_rank"] == 0 and rec["repaired"] is True
        assert rec["cause"]["cause"] == "replica_drift" and rec["cause"]["ranks"] == {"1": "replica_drift"}
        (row,) = rec["tensors"]
        assert (row["name"], row["rank"], row["elements"]) == (r0["first_param"], 1, 1)
        assert 5e-4 < row["max_abs_diff"] < 2e-3, row
        assert r0["optimizer_digest"] == r1["optimizer_digest"], "optimizer state differs across ranks"
        for r in (r0, r1):  # checks of iterations 4, 8, 12 and 16, each read one iteration later
            assert {k: r["guard"]["replicas"][k] for k in ("checks", "drifts", "repairs")} == dict(
                checks=4, drifts=1, repairs=1)

    def test_with_the_replica_check_on_and_nothing_planted_no_record_is_written(self, tmp_path: Any) -> None:
        # issue 41: BatchNorm statistics differ across ranks by design (each rank's forward updates them from its own
        # batch): they are not compared, and nothing else differs.
        (r0, r1), _ = run_workers(self.worker, "replicas_clean", str(tmp_path))
        assert (r0["error"], r1["error"]) == (None, None) and r0["digest"] == r1["digest"]
        assert incident_logs(str(tmp_path)) == []
        assert r0["guard"]["replicas"]["checks"] == r1["guard"]["replicas"]["checks"] == 2
        assert r0["guard"]["replicas"]["drifts"] == 0

    def test_nan_weights_on_one_rank_at_a_replica_check_are_left_to_the_divergence_path(self, tmp_path: Any) -> None:
        # issue 41: the NaN planted on rank 1 at iteration 12 is in the check of iteration 12; the replica check leaves
        # a non-finite difference to the divergence path, which recovers as without it.
        r0, r1, records = self.run("weights_one_rank_replicas", tmp_path)
        (rec,) = incidents(records)
        assert r0["error"] is None and r0["iter"] == 18
        assert rec["event"] == "divergence" and rec["restored_from"]["source"] == "memory"
        assert not [r for r in records if r["event"] == "replica_drift"]
        assert r0["guard"]["replicas"]["drifts"] == 0 and r0["guard"]["recoveries"] == 1

    def test_a_rank_that_raises_ends_the_job_without_a_hang(self, tmp_path: Any) -> None:
        # issue 35: rank 1 raises in iteration 12 before its guard sends the step's verdict, while rank 0's is in
        # flight; the job ends (within the harness's timeout: a hang fails the test) with rank 1's error, and no rank
        # finishes training. Rank 0 stops on gloo's closed connection (its result says so where torchrun did not stop
        # it first).
        returncode, log, results = run_failing(self.worker, "fail_rank1", str(tmp_path))
        assert returncode != 0
        assert "PlantedFailure: planted failure on rank 1 in iteration 12" in log
        assert 1 not in results
        assert all(r["error"] is not None for r in results.values())
