"""What every rank of a test job does around its runner, whichever the family: the shared scenarios, the process
group (CPU gloo, or NCCL with one GPU per rank), the run with its error kept, and the result the test reads."""
import argparse
import json
import os
import time
import traceback
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
from scenarios import weights_digest

GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)


def shared_scenarios(disk_checkpoint: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """name -> the family's ``build_runner`` keyword arguments (work_dir is added by the worker)."""
    return {
        # A NaN planted in rank 1's weights only: only rank 1's health check sees it.
        "weights_one_rank": dict(max_iters=18, guard=GUARD, faults=[dict(kind="weights", iters=[12], ranks=[1])]),
        # A NaN loss on rank 1 only, for more steps than the patience; fp32.
        "loss_one_rank": dict(amp=None, max_iters=18, guard=GUARD,
                              faults=[dict(kind="loss", iters=[11, 12, 13, 14, 15], ranks=[1])]),
        # The same NaN weights on every rank; one snapshot copy per node (its leader holds it, the others receive it).
        "weights_all_ranks": dict(max_iters=18, guard=dict(GUARD, snapshot_copies="node"),
                                  faults=[dict(kind="weights", iters=[12])]),
        # Every iteration from 12 on is poisoned on every rank: the budget runs out and all ranks stop together.
        "endless": dict(max_iters=30, guard=dict(GUARD, max_recoveries=1),
                        faults=[dict(kind="weights", iters=list(range(12, 31)))]),
        # No confirmed snapshot yet and no shared filesystem: only rank 0 has the checkpoint of iteration 10.
        "disk_no_shared_fs": dict(max_iters=16, guard=dict(GUARD, confirm_steps=1000), checkpoint=disk_checkpoint,
                                  faults=[dict(kind="weights", iters=[13], ranks=[1])], separate_work_dirs=True),
    }


def parse_args(scenarios: Dict[str, Any], fp16: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(scenarios))
    parser.add_argument("out")
    parser.add_argument("--cuda", action="store_true", help=f"NCCL, one GPU per rank, {fp16}")
    return parser.parse_args()


def init_process_group(cuda: bool) -> int:
    """gloo on the CPU; NCCL with the GPU of LOCAL_RANK on CUDA, as a user's launcher sets it up. Returns the rank.

    Initialized before the runner is built: MMEngine then skips its own init_dist.
    """
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return dist.get_rank()


def work_dir(out: str, rank: int, kwargs: Dict[str, Any]) -> str:
    """The scenario's work dir: one per rank when it asks for ``separate_work_dirs`` (no shared filesystem)."""
    separate = kwargs.pop("separate_work_dirs", False)
    return os.path.join(out, f"work_rank{rank}" if separate else "work")


def train(run: Callable[[], Any]) -> Dict[str, Any]:
    """Runs the training; the error, if any, is kept for the test to compare across ranks."""
    result: Dict[str, Any] = dict(rank=dist.get_rank(), world_size=dist.get_world_size(), error=None,
                                  error_type=None)
    t0 = time.perf_counter()
    try:
        run()
    except Exception as exc:  # the test compares the error across ranks
        result.update(error=str(exc), error_type=type(exc).__name__, traceback=traceback.format_exc())
    result["seconds"] = time.perf_counter() - t0
    return result


def side_group_report() -> Dict[str, Any]:
    """The guard's host-side (gloo) group beside the training backend: both backends, one MAX all-reduce, and
    whether the guard itself had built it (and its node group) during training."""
    from petr_stability.core import distributed as guard_dist

    # Built by the guard during training when it agreed on its verdicts (and on the node's leader).
    used = {"guard_built_it": guard_dist._GROUP is not None, "node_group": guard_dist._NODE is not None}
    group = guard_dist._host_group()
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return {"backend": dist.get_backend(), "side_backend": dist.get_backend(group), "max": int(t.item()), **used}


def finish(out: str, result: Dict[str, Any], runner: Any, model: torch.nn.Module, guard: Any, scaler: Optional[Any],
           max_norm: Optional[float], **extra: Any) -> None:
    """Writes this rank's result for the test, then leaves."""
    result.update(
        iter=runner.iter,
        digest=weights_digest(model),
        finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        guard=guard.state_dict(),
        loss_scale=float(scaler.get_scale()) if scaler is not None else None,
        max_norm=max_norm,
        snapshot_bytes=guard.ring.nbytes(),
        snapshots=len(guard.ring),
        device=str(next(model.parameters()).device),
        side_group=side_group_report(),
        **extra,
    )
    with open(os.path.join(out, f"result_rank{result['rank']}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, default=str)
    dist.barrier()
    # Leave without tearing the gloo groups down: their destructors now and then abort a process whose peer
    # has already gone ("terminate called without an active exception"), after the result was written.
    os._exit(0)
