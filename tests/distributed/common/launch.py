"""Launches a torchrun job for a test (2 CPU processes over gloo, or one process per GPU over NCCL) with a hard
timeout, and reads the ranks' results."""
import glob
import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["NPROC", "TIMEOUT_S", "SHARED", "SHARED_REMEDIES", "free_port", "launch", "run_workers", "run_failing",
           "incident_logs", "check_agreement", "run_agreeing"]


NPROC = 2
#: Guard state that records decisions and their consequences: it must be the same on every rank.
SHARED = ("recoveries", "stalls", "iterations_lost", "skipped_steps", "actions_tried")
#: Remedies whose state every rank holds alike (``remedies.<name>`` in the guard's state, issue 40's one layout).
SHARED_REMEDIES = ("clip", "dropout", "lr", "scale")
#: A healthy scenario takes 10-25 s on 2 shared CPU cores; past this it is a hang.
TIMEOUT_S = 150


def free_port() -> int:
    """A TCP port nobody listens on right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: str, scenario: str, out_dir: str, timeout: float = TIMEOUT_S, nproc: int = NPROC,
           extra_args: Sequence[str] = ()) -> Tuple[int, str]:
    """Runs ``worker scenario out_dir [extra_args]`` under ``torch.distributed.run`` on ``nproc`` local processes.

    Returns:
        (the job's exit code, its combined output). Fails the calling test if the job exceeds ``timeout`` (the
        whole process group is killed first): a hang.
    """
    import pytest

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), worker, scenario, out_dir,
           *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{scenario}: no result within {timeout}s (a hang?)\n{out.decode(errors='replace')[-4000:]}")
    return proc.returncode, out.decode(errors="replace")


def run_workers(
    worker: str, scenario: str, out_dir: str, timeout: float = TIMEOUT_S, nproc: int = NPROC,
    extra_args: Sequence[str] = (),
) -> Tuple[List[Dict[str, Any]], str]:
    """Runs a scenario every rank of which finishes (:func:`launch`).

    Returns:
        (one result dict per rank, ordered by rank; the job's combined output). Fails the calling test if the
        job exceeds ``timeout``, fails, or a rank wrote no result.
    """
    import pytest

    returncode, log = launch(worker, scenario, out_dir, timeout, nproc, extra_args)
    results = []
    for rank in range(nproc):
        path = os.path.join(out_dir, f"result_rank{rank}.json")
        if not os.path.exists(path):
            pytest.fail(f"{scenario}: rank {rank} wrote no result (exit code {returncode})\n{log[-4000:]}")
        with open(path, encoding="utf-8") as f:
            results.append(json.load(f))
    assert returncode == 0, log[-4000:]
    return results, log


def run_failing(worker: str, scenario: str, out_dir: str,
                timeout: float = TIMEOUT_S) -> Tuple[int, str, Dict[int, Dict[str, Any]]]:
    """Runs a scenario in which a rank fails (:func:`launch`; a hang fails the calling test).

    Returns:
        (the job's exit code, its combined output, the results the ranks that got that far wrote, by rank).
    """
    returncode, log = launch(worker, scenario, out_dir, timeout)
    results = {}
    for path in glob.glob(os.path.join(out_dir, "result_rank*.json")):
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
        results[result["rank"]] = result
    return returncode, log, results


def incident_logs(out_dir: str) -> List[str]:
    """Every incident log written anywhere under the test's directory."""
    return sorted(glob.glob(os.path.join(out_dir, "**", "nan_guard_incidents.jsonl"), recursive=True))


def check_agreement(r0: Dict[str, Any], r1: Dict[str, Any], out_dir: str) -> List[Dict]:
    """What must hold after every scenario: both ranks end at the same iteration with the same parameters, the same
    error type and message (or none), the same guard decisions, loss scale and clip setting; exactly one incident
    log exists.

    Returns:
        The incident records.
    """
    from petr_stability import read_incidents

    assert r0["world_size"] == NPROC
    assert r0["iter"] == r1["iter"]
    assert r0["digest"] == r1["digest"], "parameters differ across ranks"
    if r0["error"] is None:
        assert r0["finite"] and r1["finite"]
    assert (r0["error_type"], r0["error"]) == (r1["error_type"], r1["error"])
    for key in SHARED:
        assert r0["guard"][key] == r1["guard"][key], key
    for name in SHARED_REMEDIES:
        assert r0["guard"]["remedies"][name] == r1["guard"]["remedies"][name], name
    assert (r0["loss_scale"], r0["max_norm"]) == (r1["loss_scale"], r1["max_norm"])
    logs = incident_logs(out_dir)
    assert len(logs) == 1, logs
    return read_incidents(logs[0])


def run_agreeing(worker: str, scenario: str, out_dir: str) -> Tuple[Dict[str, Any], Dict[str, Any], List[Dict]]:
    """Runs a scenario and checks what must hold in every one of them (:func:`check_agreement`).

    Returns:
        (rank 0's result, rank 1's result, the incident records).
    """
    (r0, r1), _ = run_workers(worker, scenario, out_dir)
    return r0, r1, check_agreement(r0, r1, out_dir)
