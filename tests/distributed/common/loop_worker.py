"""One rank of a distributed plain-torch loop with the guard (the torch-loop family: TorchLoopIO and the driver) under
torch's DistributedDataParallel, 2 CPU processes over gloo; writes its result as JSON for the test.

The model has a BatchNorm layer (its running statistics differ across ranks by design: each rank's forward updates them
from its own batch) and every rank reads its own data. Faults are planted after the optimizer step, before the guard.
"""
import json
import os
import sys
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scenarios import weights_digest  # noqa: E402
from worker_common import RankPlan, optimizer_digest  # noqa: E402

from petr_stability.adapters.driver import GuardDriver  # noqa: E402
from petr_stability.adapters.torch_loop import TorchLoopIO  # noqa: E402
from petr_stability.core.config import GuardConfig  # noqa: E402
from petr_stability.core.faults import poison_weights  # noqa: E402

GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5, replica_check_interval=4)
SCENARIOS: Dict[str, Dict[str, Any]] = {
    # +1e-3 on one weight of rank 1 after its step of iteration 10: the check of iteration 12 (read at 13) finds it.
    "drift": dict(iters=18, plan=dict(drift=dict(rank=1, at=10))),
    # Nothing planted.
    "clean": dict(iters=18),
    # NaN in one weight of rank 1 after its step of iteration 12, the iteration of a replica check.
    "nan": dict(iters=18, nan=dict(rank=1, at=12)),
    # Rank 1 drifts again after every repair: the third drift within ten checks stops the run, naming it.
    "keeps_drifting": dict(iters=30, plan=dict(drift=dict(rank=1, at=[2, 6, 10, 14, 18]))),
    # The last iteration is a check iteration: the run's end (driver.finish) reads it.
    "drift_at_the_end": dict(iters=16, plan=dict(drift=dict(rank=1, at=15))),
}


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    spec = SCENARIOS[scenario]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lines = []
    io = TorchLoopIO(model, opt, None, {"max_norm": 35.0, "norm_type": 2}, os.path.join(out, "work"),
                     log_fn=lines.append, max_iters=spec["iters"])
    driver = GuardDriver(GuardConfig(**GUARD))
    driver.bind(io)
    driver.start()
    plan = RankPlan(**spec.get("plan", {}))
    data = torch.Generator().manual_seed(100 + rank)
    result: Dict[str, Any] = {"rank": rank, "error": None, "error_type": None}
    try:
        while io.iter < spec["iters"]:
            x = torch.randn(4, 8, generator=data)
            driver.before_iter(x)
            loss = ddp(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            io.clip(model.parameters())
            opt.step()
            io.last_loss = float(loss.detach())
            plan.after_step(io.iter, model)
            nan = spec.get("nan")
            if nan and rank == nan["rank"] and io.iter + 1 == nan["at"] and not result.get("nan_planted"):
                result["nan_planted"] = poison_weights(model)
            driver.after_iter()
            io.iter += 1
        driver.finish()
    except Exception as exc:  # the test compares the error across ranks
        result.update(error=str(exc), error_type=type(exc).__name__, error_ranks=getattr(exc, "ranks", None))
    result.update(iter=io.iter, digest=weights_digest(model), optimizer_digest=optimizer_digest([opt]),
                  guard=driver.guard.state_dict(), lines=lines, replicas_on=driver.guard.replicas.on,
                  first_param=next(n for n, _ in model.named_parameters()), planted=plan.drifted)
    with open(os.path.join(out, f"result_rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, default=str)
    dist.barrier()
    os._exit(0)  # without tearing down the gloo groups (their destructors can abort a process whose peer left)


if __name__ == "__main__":
    main()
