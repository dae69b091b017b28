"""One rank of a 2-process gloo job that exercises core/distributed.py directly (no runner)."""
import collections
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from petr_stability.core import distributed


def state(seed: int) -> dict:
    """Nested state with every dtype a checkpoint holds, filled from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 3, generator=g)
    return {
        "state_dict": collections.OrderedDict(w=w, half=w.half(), bf16=w.bfloat16(), t=w.t(), scalar=w.sum()),
        "optimizer": {"state": {0: {"step": torch.tensor(7.0 + seed), "exp_avg": torch.randn(3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "mask": torch.rand(5, generator=g) > 0.5,
        "ids": torch.arange(6) * (seed + 1),
        "meta": {"iter": 9, "names": ("a", "b")},
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def main() -> None:
    out = sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res = {"rank": rank}
    res["reduce_max"] = distributed.reduce_max([rank, 5 - rank])
    # issue 35: an asynchronous MAX issued late on one rank, another collective in between, read after it.
    if rank == 1:
        time.sleep(0.2)
    pending = distributed.reduce_max_async([3 * rank, 7 - rank])
    res["between"] = distributed.gather(rank)
    res["async_max"] = pending.wait()
    # Rank 0 reads, the others receive everything (a disk restore).
    got = distributed.broadcast_payload(state(0) if rank == 0 else None)
    res["full"] = same(got, state(0))
    # The receiver knows the structure (a per-node snapshot): only tensors travel.
    skeleton = distributed.strip_tensors(state(rank))[0]
    got = distributed.broadcast_payload(state(0) if rank == 0 else skeleton, known_structure=True)
    res["known"] = same(got, state(0))
    group, leader, ranks = distributed.node_group()
    res["node"] = [leader, ranks]
    # A structure that differs must stop every rank, not leave rank 0 waiting.
    other = distributed.strip_tensors(dict(state(1), extra=torch.zeros(2)))[0]
    try:
        distributed.broadcast_payload(state(0) if rank == 0 else other, src=leader, group=group, known_structure=True)
        res["mismatch"] = None
    except RuntimeError as exc:
        res["mismatch"] = str(exc)
    res["after"] = distributed.reduce_max([1])  # the group is still usable, in step
    with open(os.path.join(out, f"result_rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(res, f)
    dist.barrier()
    # Leave without tearing the gloo groups down: their destructors now and then abort a process whose peer
    # has already gone ("terminate called without an active exception"), after the result was written.
    os._exit(0)


if __name__ == "__main__":
    main()
