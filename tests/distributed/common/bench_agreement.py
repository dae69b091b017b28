"""Measures what the guard's cross-rank agreement costs: run it under torchrun (see docs/distributed.md).

Prints, on rank 0, one JSON object: the gloo host all-reduce per call (the guard makes one per iteration),
a healthy DDP training iteration of the PETR-shaped model for scale, snapshot bytes, and the time to send a
snapshot-sized state from rank 0 to the others (a disk or per-node restore).
"""
import json
import statistics
import time

import torch
import torch.distributed as dist

from petr_stability.core import distributed
from petr_stability.core.recovery.snapshot import copy_to_host
from petr_stability.core.tree import nbytes as payload_nbytes
from petr_stability.testing.petr_like import build_petr_like, make_batch

__all__ = ["main"]


def _timed(fn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    """Runs the measurements and prints them on rank 0."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = build_petr_like(num_layers=1, num_query=16)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    batch = torch.utils.data.default_collate(make_batch(2, num_query=16, seed=dist.get_rank()))

    def step():
        # A data-parallel step as DDP does it (gradients all-reduced), over the loss API the tests use.
        opt.zero_grad()
        loss = sum(model.losses(batch["inputs"], batch["cls_t"], batch["reg_t"]).values())
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        opt.step()
        float(loss.detach())

    _timed(step, 3)
    iteration = _timed(step, 20)
    distributed.reduce_max([0])
    agree = _timed(lambda: distributed.reduce_max([0]), 2000)
    payload = copy_to_host({"state_dict": model.state_dict(), "optimizer": opt.state_dict()})
    nbytes = payload_nbytes(payload)
    distributed.broadcast_payload(payload)
    send = _timed(lambda: distributed.broadcast_payload(payload), 5)
    if dist.get_rank() == 0:
        it, ag = statistics.median(iteration), statistics.median(agree)
        print(json.dumps({
            "world_size": dist.get_world_size(),
            "iteration_s_median": it,
            "agreement_us_median": ag * 1e6,
            "agreement_us_p99": sorted(agree)[int(0.99 * len(agree))] * 1e6,
            "agreement_over_iteration": ag / it,
            "agreement_over_1s_petr_iteration": ag / 1.0,
            "snapshot_bytes": nbytes,
            "params": sum(p.numel() for p in model.parameters()),
            "broadcast_snapshot_s_median": statistics.median(send),
            "broadcast_MB_per_s": nbytes / statistics.median(send) / 1e6,
        }, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
