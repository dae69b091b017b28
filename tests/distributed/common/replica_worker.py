"""One rank of a 2-process gloo job that exercises core/watch/replicas.py directly (no runner, no driver): the check
issued and read, a drift repaired, a NaN left alone, a check outlived by a rollback, and the runs it stays off in."""
import json
import os
import sys
import types
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from petr_stability.core.watch.detector import StepSignals
from petr_stability.core.watch.replicas import ReplicaCheck


def model(seed: int = 0, extra: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    if extra:
        net.register_parameter("extra", nn.Parameter(torch.zeros(3)))
    return net


def io_for(net: nn.Module, lines: List[str]) -> Any:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(4, 4)).sum().backward()
    opt.step()  # optimizer state exists (the same on both ranks: same seed, same data)
    return types.SimpleNamespace(model=lambda: net, optimizers=lambda: [opt],
                                 log=lambda msg, level="info": lines.append(f"[{level}] {msg}"))


def state_bytes(io: Any) -> List[str]:
    out = [t.detach().numpy().tobytes().hex() for t in io.model().parameters()]
    out += [v.numpy().tobytes().hex() for s in io.optimizers()[0].state.values() for v in s.values()
            if isinstance(v, torch.Tensor)]
    return out


def check(check: ReplicaCheck, io: Any, iteration: int, token: int = 0, now_token: int = 0) -> Dict[str, Any]:
    check.issue(io, StepSignals(iteration), 0, token)
    outcome = check.conclude(io, iteration + 1, now_token)
    return {"records": outcome.records, "repaired": outcome.repaired, "clean_since": outcome.clean_since,
            "error": None if outcome.error is None else [type(outcome.error).__name__, str(outcome.error)]}


def main() -> None:
    out = sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: Dict[str, Any] = {"rank": rank}
    lines: List[str] = []
    io = io_for(model(), lines)
    replicas = ReplicaCheck(4, max_recoveries=5, log_path="the/log")
    replicas.start(io, 0)
    res["on"] = replicas.on
    res["clean"] = check(replicas, io, 4)
    first = next(io.model().parameters())
    if rank == 1:  # a finite drift in one weight and in one optimizer moment of rank 1
        with torch.no_grad():
            first.view(-1)[3] += 1e-3
        io.optimizers()[0].state[first]["exp_avg"].view(-1)[0] += 1.0
    res["before"] = state_bytes(io)
    res["drift"] = check(replicas, io, 8)
    res["after"] = state_bytes(io)
    kept = float(first.view(-1)[0])
    if rank == 0:  # a NaN on the rank whose copy would be the reference
        with torch.no_grad():
            first.view(-1)[0] = float("nan")
    res["nan"] = check(replicas, io, 12)
    res["nan_left"] = not bool(torch.isfinite(first).all()) if rank == 0 else True
    with torch.no_grad():
        first.view(-1)[0] = kept
    res["outlived"] = check(replicas, io, 16, token=0, now_token=1)  # a rollback came between issue and read
    res["counts"] = replicas.counts
    # The runs it stays off in, each with its one log line.
    for name, net in (("structure", model(extra=rank == 1)), ("weights", model(seed=rank))):
        off = ReplicaCheck(4)
        lines.clear()
        off.start(io_for(net, lines), 0)
        res[f"off_{name}"] = [off.on, list(lines)]
    sharded = model()
    if rank == 1:  # stands for FSDP2's or a tensor-parallel plan's sharded parameter
        sharded[0].weight = type("DTensor", (nn.Parameter,), {})(sharded[0].weight.detach())
    off = ReplicaCheck(4)
    lines.clear()
    off.start(io_for(sharded, lines), 0)
    res["off_sharded"] = [off.on, list(lines)]
    with open(os.path.join(out, f"result_rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(res, f, default=str)
    dist.barrier()
    os._exit(0)  # without tearing down the gloo groups (their destructors can abort a process whose peer left)


if __name__ == "__main__":
    main()
