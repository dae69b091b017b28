"""What each rank of a test job does before and after its runner, on CPU (gloo) or one GPU per rank (NCCL)."""
import os
from typing import Any, Dict

import torch
import torch.distributed as dist


def init_process_group(cuda: bool) -> None:
    """gloo on the CPU; NCCL with the GPU of LOCAL_RANK on CUDA, as a user's launcher sets it up.

    Initialized before the runner is built: MMEngine then skips its own init_dist.
    """
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


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
