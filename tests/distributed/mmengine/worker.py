"""One rank of a 2-process CPU (gloo) MMEngine run with NanGuardHook; writes its result as JSON for the test."""
import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "mmengine"))
sys.path.insert(0, os.path.join(HERE, "..", "common"))

SMALL = dict(num_layers=1, num_query=16)
GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)

#: name -> build_runner keyword arguments (work_dir, launcher and cfg are added by the worker).
SCENARIOS = {
    # A NaN planted in rank 1's weights only: only rank 1's health check sees it.
    "weights_one_rank": dict(max_iters=18, guard=GUARD, faults=[dict(kind="weights", iters=[12], ranks=[1])]),
    # A NaN loss on rank 1 only (MMEngine does not all-reduce the loss), for more steps than the patience.
    "loss_one_rank": dict(amp=None, max_iters=18, guard=GUARD,
                          faults=[dict(kind="loss", iters=[11, 12, 13, 14, 15], ranks=[1])]),
    # The same NaN weights on every rank; one snapshot copy per node (rank 0 holds it, rank 1 receives it).
    "weights_all_ranks": dict(max_iters=18, guard=dict(GUARD, snapshot_copies="node"),
                              faults=[dict(kind="weights", iters=[12])]),
    # Every iteration from 12 on is poisoned on every rank: the budget runs out and all ranks stop together.
    "endless": dict(max_iters=30, guard=dict(GUARD, max_recoveries=1),
                    faults=[dict(kind="weights", iters=list(range(12, 31)))]),
    # Epoch-based loop, a checkpoint at each epoch end (rank 0 only): NaN weights on rank 1 just before it.
    "epoch_save_one_rank": dict(max_iters=None, max_epochs=2, n_samples=32, amp=dict(init_scale=512.0), guard=GUARD,
                                checkpoint=dict(interval=1), faults=[dict(kind="weights", iters=[8], ranks=[1])]),
    # No confirmed snapshot yet and no shared filesystem: only rank 0 has the checkpoint of iteration 10.
    "disk_no_shared_fs": dict(max_iters=16, guard=dict(GUARD, confirm_steps=1000), checkpoint=dict(interval=10),
                              faults=[dict(kind="weights", iters=[13], ranks=[1])], separate_work_dirs=True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("out")
    parser.add_argument("--cuda", action="store_true", help="NCCL, one GPU per rank, MMEngine's AmpOptimWrapper")
    args = parser.parse_args()
    from rank_setup import init_process_group, side_group_report

    init_process_group(args.cuda)
    rank = dist.get_rank()
    from harness import build_runner, guard_hook
    from scenarios import weights_digest

    kwargs = dict(SCENARIOS[args.scenario])
    separate = kwargs.pop("separate_work_dirs", False)
    work_dir = os.path.join(args.out, f"work_rank{rank}" if separate else "work")
    kwargs.setdefault("model_kwargs", SMALL)
    if args.cuda:  # MMEngine's own DDP wrapping (device_ids=[LOCAL_RANK]) and its own AmpOptimWrapper
        kwargs.update(amp_type="AmpOptimWrapper")
    else:
        kwargs.update(cfg=dict(model_wrapper_cfg=dict(type="MMDistributedDataParallel", device_ids=None)))
    runner = build_runner(work_dir, launcher="pytorch", **kwargs)
    result = dict(rank=rank, world_size=dist.get_world_size(), error=None, error_type=None)
    t0 = time.perf_counter()
    try:
        runner.train()
    except Exception as exc:  # the test compares the error across ranks
        result.update(error=str(exc), error_type=type(exc).__name__, traceback=traceback.format_exc())
    result["seconds"] = time.perf_counter() - t0
    model = runner.model.module if hasattr(runner.model, "module") else runner.model
    guard = guard_hook(runner).guard
    scaler = getattr(runner.optim_wrapper, "loss_scaler", None)
    result.update(
        iter=runner.iter,
        digest=weights_digest(model),
        finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        guard=guard.state_dict(),
        loss_scale=float(scaler.get_scale()) if scaler is not None else None,
        max_norm=runner.optim_wrapper.clip_grad_kwargs.get("max_norm"),
        snapshot_bytes=guard.ring.nbytes(),
        snapshots=len(guard.ring),
        device=str(next(model.parameters()).device),
        optim_wrapper=type(runner.optim_wrapper).__name__,
        side_group=side_group_report(),
    )
    with open(os.path.join(args.out, f"result_rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, default=str)
    dist.barrier()
    # Leave without tearing the gloo groups down: their destructors now and then abort a process whose peer
    # has already gone ("terminate called without an active exception"), after the result was written.
    os._exit(0)


if __name__ == "__main__":
    main()
