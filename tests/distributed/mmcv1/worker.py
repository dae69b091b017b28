"""One rank of a 2-process CPU (gloo) MMCV 1.x run (MMDistributedDataParallel, IterBasedRunner) with NanGuardHook."""
import argparse
import json
import os
import sys
import time
import traceback
import types

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "mmcv1"))
sys.path.insert(0, os.path.join(HERE, "..", "common"))

GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)

#: name -> harness.build_runner keyword arguments (IterBasedRunner; work_dir is added by the worker).
SCENARIOS = {
    # A NaN planted in rank 1's weights only: only rank 1's health check sees it.
    "weights_one_rank": dict(max_iters=18, guard=GUARD, faults=[dict(kind="weights", iters=[12], ranks=[1])]),
    # A NaN loss on rank 1 only, for more steps than the patience (fp32: OptimizerHook).
    "loss_one_rank": dict(amp=None, max_iters=18, guard=GUARD,
                          faults=[dict(kind="loss", iters=[11, 12, 13, 14, 15], ranks=[1])]),
    # The same NaN weights on every rank; one snapshot copy per node.
    "weights_all_ranks": dict(max_iters=18, guard=dict(GUARD, snapshot_copies="node"),
                              faults=[dict(kind="weights", iters=[12])]),
    # Every iteration from 12 on is poisoned on every rank: the budget runs out and all ranks stop together.
    "endless": dict(max_iters=30, guard=dict(GUARD, max_recoveries=1),
                    faults=[dict(kind="weights", iters=list(range(12, 31)))]),
    # No confirmed snapshot and no shared filesystem: only rank 0 has the checkpoint of iteration 10.
    "disk_no_shared_fs": dict(max_iters=16, guard=dict(GUARD, confirm_steps=1000),
                              checkpoint=dict(interval=10, by_epoch=False),
                              faults=[dict(kind="weights", iters=[13], ranks=[1])], separate_work_dirs=True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("out")
    parser.add_argument("--cuda", action="store_true", help="NCCL, one GPU per rank, MMCV's Fp16OptimizerHook")
    args = parser.parse_args()
    from rank_setup import init_process_group, side_group_report

    init_process_group(args.cuda)
    rank = dist.get_rank()
    from harness import build_runner, guard_hook
    from mmcv.parallel import MMDistributedDataParallel
    from mmcv.runner import iter_based_runner
    from scenarios import weights_digest
    from torch.utils.data import DataLoader, DistributedSampler

    iter_based_runner.time = types.SimpleNamespace(sleep=lambda s: None)  # the runner's 2 s start-up nap
    kwargs = dict(SCENARIOS[args.scenario])
    separate = kwargs.pop("separate_work_dirs", False)
    work_dir = os.path.join(args.out, f"work_rank{rank}" if separate else "work")
    if args.cuda:
        kwargs.update(device="cuda", fp16_type="Fp16OptimizerHook")
    r = build_runner(work_dir, runner="iter", n_samples=32, **kwargs)
    # As mmdet's train_detector does for distributed runs: DDP around the model, a DistributedSampler.
    module = r.model.module if args.cuda else r.model  # (on CUDA the harness put it in MMDataParallel)
    r.model = MMDistributedDataParallel(module, device_ids=[torch.cuda.current_device()] if args.cuda else None,
                                        broadcast_buffers=False)
    dataset = r.loader.dataset
    r.loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False))
    result = dict(rank=rank, world_size=dist.get_world_size(), error=None, error_type=None)
    t0 = time.perf_counter()
    try:
        r.run([r.loader], [("train", 1)])
    except Exception as exc:  # the test compares the error across ranks
        result.update(error=str(exc), error_type=type(exc).__name__, traceback=traceback.format_exc())
    result["seconds"] = time.perf_counter() - t0
    model = r.model.module
    guard = guard_hook(r).guard
    hook = next(h for h in r.hooks if hasattr(h, "clip_grads"))
    scaler = getattr(hook, "loss_scaler", None)
    result.update(
        iter=r.iter,
        digest=weights_digest(model),
        finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        guard=guard.state_dict(),
        loss_scale=float(scaler.get_scale()) if scaler is not None else None,
        max_norm=(hook.grad_clip or {}).get("max_norm"),
        snapshot_bytes=guard.ring.nbytes(),
        snapshots=len(guard.ring),
        device=str(next(model.parameters()).device),
        optimizer_hook=type(hook).__name__,
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
