"""What every rank of a test job does around its runner, whichever the family: the shared scenarios, the process
group (CPU gloo, or NCCL with one GPU per rank), the run with its error kept, and the result the test reads."""
import argparse
import json
import os
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from scenarios import OLDER_CHECKPOINT, weights_digest

from petr_stability.core.faults import poison_weights

__all__ = ["GUARD", "CORRUPT_LABEL", "shared_scenarios", "parse_args", "init_process_group", "work_dir", "train",
           "finish", "Extras", "corrupt_labels", "fail_on_corrupt_labels", "PoisonPasses", "PlantedFailure", "RankPlan",
           "plant_drift", "optimizer_digest", "write_older_checkpoint"]

GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)
#: A class label the label map does not know: the data trigger of the corrupt-annotation scenarios.
CORRUPT_LABEL = -1
#: Rank 1 reads a corrupt sample in 6 consecutive batches from its 3rd on; with GUARD nothing is confirmed before
#: iteration 4, and the data moves on through rollbacks as a real loader does. 128 samples: one epoch is 32 batches
#: per rank, so no corrupt sample comes round again.
CORRUPT = dict(rank=1, positions=[3, 4, 5, 6, 7, 8])
#: The dataset index of the sample with a NaN box: odd, so rank 1 reads it (unshuffled, 2 ranks), in its 3rd batch.
BAD_BOX = 9
#: A saturated frame's every value: finite in fp16 (largest 65504), but the projection's fp16 sums of it pass that
#: wherever a unit's 64 weights add up to more than 1.1 in size (about 1 unit in 16 at initialization).
BRIGHT = 6e4
#: One iteration poisoned on several passes (a rollback brings the run back to it) spends one in-memory restore
#: point per pass. No replay of the failing batch: its cause classification is not what the scenario is about.
TO_DISK = dict(snapshot_interval=1000, confirm_steps=1000, check_interval=1000, diagnose=False)


def shared_scenarios(disk_checkpoint: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """name -> the family's ``build_runner`` keyword arguments (work_dir is added by the worker)."""
    return {
        # A NaN planted in rank 1's weights only, twice: only rank 1's health check sees it. The first divergence is
        # rolled back alone on every rank (issue 43: written between two steps), the second climbs the ladder.
        "weights_one_rank": dict(max_iters=18, guard=GUARD,
                                 faults=[dict(kind="weights", iters=[12, 14], ranks=[1])]),
        # A NaN loss on rank 1 only, for more steps than the patience; fp32.
        "loss_one_rank": dict(amp=None, max_iters=18, guard=GUARD,
                              faults=[dict(kind="loss", iters=[11, 12, 13, 14, 15], ranks=[1])]),
        # The same NaN weights on every rank; one snapshot copy per node (its leader holds it, the others receive it).
        "weights_all_ranks": dict(max_iters=18, guard=dict(GUARD, snapshot_copies="node"),
                                  faults=[dict(kind="weights", iters=[12])]),
        # Every iteration from 12 on is poisoned on every rank: the budget runs out and all ranks stop together.
        "endless": dict(max_iters=30, guard=dict(GUARD, max_recoveries=1),
                        faults=[dict(kind="weights", iters=list(range(12, 31)))]),
        # No shared filesystem: only rank 0 has the checkpoint of iteration 4. Rank 1's weights are poisoned at
        # iteration 6 on two passes: the start state, then the disk. A dynamic scale starting at 2**30 calibrates
        # (overflows) over the first ~20 steps: no snapshot exists, the start state is the only in-memory point.
        "disk_no_shared_fs": dict(amp=dict(init_scale=2.0 ** 30), max_iters=8, guard=TO_DISK,
                                  checkpoint=dict(disk_checkpoint, interval=4), passes=dict(at=6, count=2, ranks=[1]),
                                  separate_work_dirs=True),
        # Rank 1 reads corrupt samples (its loss is NaN) for 6 consecutive steps before anything is confirmed; the
        # work dir also holds an older run's later checkpoint. A static 512 scale (PETR's), a dynamic one
        # (calibrating over the first ~7 steps: the start state is the only healthy state early on), fp32; with
        # the guard's defaults (the failing batch is replayed and classified) and without the replay.
        **{f"corrupt_rank1_{scale}{suffix}": dict(amp=amp, max_iters=18, n_samples=128, guard=dict(GUARD, **guard),
                                                  corrupt=CORRUPT, older_run=True)
           for scale, amp in (("static", 512.0), ("dynamic", "dynamic"), ("fp32", None))
           for suffix, guard in (("", {}), ("_no_replay", dict(diagnose=False)))},
        # One sample with a NaN box (a degenerate annotation) read by rank 1 only, in every pass over the data: its
        # step goes wrong once per pass. 64 samples: the default bound is 1 sample, as tight as it gets. Three
        # passes of 16 iterations: it recurs in the second and is never read in the third.
        **{f"bad_box_rank1_{scale}": dict(amp=amp, max_iters=48, n_samples=64, guard=GUARD, bad_box=BAD_BOX)
           for scale, amp in (("fp32", None), ("dynamic", "dynamic"))},
        # One sample with NaN pixels read by rank 1 only: its BatchNorm statistics turn NaN, a divergence at once.
        # 2048 samples: the default bound of a realistic dataset (0.1%: 2 samples).
        "bad_pixels_rank1_large": dict(amp=None, max_iters=24, n_samples=2048, guard=GUARD, bad_pixels=BAD_BOX),
        # issue 43: one bright but finite frame (every value BRIGHT, within fp16's range) read by rank 1 only, in
        # every pass: the backbone's fp16 projection sums it past fp16's largest value in its row alone. As on one
        # rank, it is the sample's data (quarantined), not the module's (no fp32, no rate change). 64 samples, three
        # passes of 16 iterations.
        "bright_rank1_dynamic": dict(amp="dynamic", max_iters=48, n_samples=64, guard=GUARD, bright=BAD_BOX),
        # issue 35: rank 1 sleeps after every optimizer step, before the guard (where a blocking agreement would make
        # rank 0 wait for it), and NaN weights are planted on it alone: rank 0 learns of it from the slow rank.
        "slow_rank1": dict(max_iters=18, guard=GUARD, faults=[dict(kind="weights", iters=[12], ranks=[1])],
                           plan=dict(slow=dict(rank=1, seconds=0.05))),
        # issue 35: rank 1 raises in iteration 12, after its optimizer step, before its guard sends the step's verdict
        # (rank 0's is in flight, waiting for it, while rank 0 trains on); nothing catches it (as in a training
        # script): the job must end, not hang.
        "fail_rank1": dict(max_iters=18, guard=GUARD, plan=dict(fail=dict(rank=1, at=12))),
        # issue 41: +1e-3 on one weight of rank 1 after its step of iteration 10, no NaN anywhere; the replicas are
        # compared every 4 iterations: the check of iteration 12 (read at 13) is the first after it.
        "drift_rank1": dict(max_iters=18, guard=dict(GUARD, replica_check_interval=4),
                            plan=dict(drift=dict(rank=1, at=10))),
        # issue 41: the replica check on, nothing planted (BatchNorm statistics differ across ranks by design).
        "replicas_clean": dict(max_iters=10, guard=dict(GUARD, replica_check_interval=4)),
        # issue 41: weights_one_rank with a replica check at the iteration the NaN is planted in.
        "weights_one_rank_replicas": dict(max_iters=18, guard=dict(GUARD, replica_check_interval=4),
                                          faults=[dict(kind="weights", iters=[12], ranks=[1])]),
    }


class Extras:
    """What a scenario asks for beyond the family's ``build_runner`` arguments (popped from them).

    Args:
        kwargs: the scenario's arguments; ``corrupt``, ``passes`` and ``older_run`` are removed from it.
    """

    def __init__(self, kwargs: Dict[str, Any]) -> None:
        self.corrupt: Optional[Dict[str, Any]] = kwargs.pop("corrupt", None)
        self.passes: Optional[Dict[str, Any]] = kwargs.pop("passes", None)
        self.older_run: bool = kwargs.pop("older_run", False)
        self.bad_box: Optional[int] = kwargs.pop("bad_box", None)
        self.bad_pixels: Optional[int] = kwargs.pop("bad_pixels", None)
        self.bright: Optional[int] = kwargs.pop("bright", None)
        plan = kwargs.pop("plan", None)
        self.plan: Optional[RankPlan] = RankPlan(**plan) if plan else None
        self.batch_size: int = kwargs.get("batch_size", 2)

    def apply(self, samples: List[Dict[str, Any]], net: torch.nn.Module) -> None:
        """Corrupts the samples a rank reads and makes the model's loss NaN on them (every rank builds the same
        dataset, so every rank does this; only the named rank ever reads a corrupt sample)."""
        if self.corrupt is not None:
            corrupt_labels(samples, self.corrupt["rank"], dist.get_world_size(), self.batch_size,
                           self.corrupt["positions"])
            fail_on_corrupt_labels(net)
        if self.bad_box is not None:
            box = samples[self.bad_box]["reg_t"].clone()
            box[0] = float("nan")
            samples[self.bad_box] = dict(samples[self.bad_box], reg_t=box)
            fail_on_corrupt_labels(net)
        if self.bad_pixels is not None:
            pixels = samples[self.bad_pixels]["inputs"].clone()
            pixels[:4] = float("nan")
            samples[self.bad_pixels] = dict(samples[self.bad_pixels], inputs=pixels)
        if self.bright is not None:
            pixels = torch.full_like(samples[self.bright]["inputs"], BRIGHT)
            samples[self.bright] = dict(samples[self.bright], inputs=pixels)


def corrupt_labels(samples: List[Dict[str, Any]], rank: int, world_size: int, batch_size: int,
                   positions: Sequence[int]) -> None:
    """Gives the first sample of ``rank``'s batches at ``positions`` (1-based, in the order the rank reads its data)
    the label :data:`CORRUPT_LABEL`. Both families' samplers here (DistributedSampler and MMEngine's DefaultSampler,
    unshuffled) give rank ``r`` the indices ``r, r + world_size, ...``."""
    for pos in positions:
        index = rank + world_size * (pos - 1) * batch_size
        samples[index] = dict(samples[index], cls_t=torch.full_like(samples[index]["cls_t"], CORRUPT_LABEL))


def fail_on_corrupt_labels(net: torch.nn.Module) -> None:
    """Makes ``net.losses`` NaN (and its gradients with it) on a batch holding a corrupt label or a NaN box, as a loss
    term that the head does not wrap in ``nan_to_num`` does on a degenerate annotation."""
    losses = net.losses

    def checked(inputs: torch.Tensor, cls_t: torch.Tensor, reg_t: torch.Tensor) -> Dict[str, torch.Tensor]:
        corrupt = cls_t == CORRUPT_LABEL
        out = losses(inputs, cls_t.masked_fill(corrupt, 0), torch.nan_to_num(reg_t))
        if bool(corrupt.any()) or not bool(torch.isfinite(reg_t).all()):
            out = {k: v * float("nan") for k, v in out.items()}
        return out

    net.losses = checked


class PoisonPasses:
    """NaN in the weights each of the first ``count`` times iteration ``at`` (1-based) starts on ``ranks``.

    The fire drill's faults fire once per iteration number; a rollback brings the run back to the same number,
    and this poisons it again (each family's worker calls :meth:`before_iter` from a hook).
    """

    def __init__(self, at: int, count: int, ranks: Optional[Sequence[int]] = None) -> None:
        self.at, self.left, self.ranks = at, count, ranks

    def before_iter(self, counter: int, model: torch.nn.Module) -> None:
        """``counter``: the runner's 0-based counter of the iteration about to run."""
        rank = dist.get_rank()
        if counter + 1 == self.at and self.left > 0 and (self.ranks is None or rank in self.ranks):
            self.left -= 1
            poison_weights(model)


class PlantedFailure(BaseException):
    """A rank's training raises something nothing catches (a bug in user code, an out-of-memory): a
    ``BaseException``, so that :func:`train`'s ``except Exception`` lets it end the process as a training script
    would."""


class RankPlan:
    """What a rank does after each optimizer step, before the guard sees it (each family's worker calls
    :meth:`after_step` from a hook that runs between the two): sleep (a slow rank), raise (a failing rank), or change
    one weight by a finite amount (a replica that drifts: a silent memory fault, a rank-local write).

    Args:
        slow: ``dict(rank, seconds)``: that rank sleeps this long in every iteration. Defaults to None.
        fail: ``dict(rank, at)``: that rank raises :class:`PlantedFailure` in iteration ``at`` (1-based). Defaults to
            None.
        drift: ``dict(rank, at, delta=1e-3)``: that rank adds ``delta`` to the first element of the model's first
            trainable parameter in iteration(s) ``at`` (1-based; an int or a list), each once (a rollback brings the
            number round again). Defaults to None.
    """

    def __init__(self, slow: Optional[Dict[str, Any]] = None, fail: Optional[Dict[str, Any]] = None,
                 drift: Optional[Dict[str, Any]] = None) -> None:
        self.slow, self.fail, self.drift = slow, fail, drift
        self.drifted: List[int] = []

    def after_step(self, counter: int, model: Optional[torch.nn.Module] = None) -> None:
        """``counter``: the runner's 0-based counter of the iteration that just stepped; ``model``: the unwrapped
        model (for ``drift``)."""
        rank = dist.get_rank()
        if self.slow is not None and rank == self.slow["rank"]:
            time.sleep(self.slow["seconds"])
        if self.fail is not None and rank == self.fail["rank"] and counter + 1 == self.fail["at"]:
            raise PlantedFailure(f"planted failure on rank {rank} in iteration {counter + 1}")
        if self.drift is not None and rank == self.drift["rank"] and counter + 1 not in self.drifted:
            at = self.drift["at"]
            if counter + 1 in (at if isinstance(at, list) else [at]):
                self.drifted.append(counter + 1)
                plant_drift(model, self.drift.get("delta", 1e-3))


def plant_drift(model: torch.nn.Module, delta: float) -> str:
    """Adds ``delta`` to the first element of ``model``'s first trainable parameter (no NaN: a finite drift); returns
    its name."""
    name, p = next((n, p) for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        p.view(-1)[0] += delta
    return name


def optimizer_digest(optimizers: Sequence[Any]) -> str:
    """A hash of every optimizer's state tensors (their bytes), to compare across ranks."""
    import hashlib

    h = hashlib.sha256()
    for optimizer in optimizers:
        for index, state in sorted(optimizer.state_dict()["state"].items()):
            for key, value in sorted(state.items()):
                if isinstance(value, torch.Tensor):
                    h.update(f"{index}.{key}".encode())
                    h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_older_checkpoint(directory: str, model: torch.nn.Module, guard_state_in_meta: bool) -> str:
    """Writes, on rank 0, the checkpoint an older guarded run left in the work dir at a later iteration
    (:data:`~scenarios.OLDER_CHECKPOINT`): finite weights, its own run id (MMEngine keeps the guard's state at the
    top level, MMCV 1.x in ``meta``). Returns its path."""
    path = os.path.join(directory, OLDER_CHECKPOINT)
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        guard = {"version": 2, "run_id": "an-older-run", "recoveries": 0}
        meta: Dict[str, Any] = {"iter": 40, "epoch": 1}
        ckpt: Dict[str, Any] = {"meta": meta, "state_dict": {k: v.detach().clone() for k, v in
                                                             model.state_dict().items()}}
        if guard_state_in_meta:
            meta["nan_guard"] = guard
        else:
            ckpt["nan_guard"] = guard
        torch.save(ckpt, path)
    dist.barrier()
    return path


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
    path = os.path.join(out, f"result_rank{result['rank']}.json")
    if result["error"] is not None:  # what is known before any collective: a peer may be gone (fail_rank1)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, default=str)
    result.update(
        iter=runner.iter,
        digest=weights_digest(model),
        finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        guard=guard.state_dict(),
        loss_scale=float(scaler.get_scale()) if scaler is not None else None,
        max_norm=max_norm,
        snapshot_bytes=guard.points.ring.nbytes(),
        snapshots=len(guard.points.ring),
        device=str(next(model.parameters()).device),
        side_group=side_group_report(),
        agreement={"deferred": guard.agreement.deferred, "blocking": guard.agreement.blocking},
        optimizer_digest=optimizer_digest(guard.io.optimizers()),
        first_param=next(n for n, p in model.named_parameters() if p.requires_grad),
        **extra,
    )
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, default=str)
    dist.barrier()
    # Leave without tearing the gloo groups down: their destructors now and then abort a process whose peer
    # has already gone ("terminate called without an active exception"), after the result was written.
    os._exit(0)
