"""Measures the guard's per-step agreement on the critical path, today's blocking all-reduce against the verdict agreed
one iteration later (issue 35); run it under torchrun at 2, 4 and 8 ranks (docs/distributed.md, docs/benchmarks.md).

Every rank trains a small model under DDP (gloo, CPU) through the plain-torch adapter and the driver, with the guard at
its defaults. Both ways of agreeing run in one job, in interleaved blocks of steps, so machine drift cancels:
``blocking`` (every step agreed at once, as before issue 35) and ``deferred`` (the guard as it is). Three conditions:

- ``even``: every rank trains at its own pace;
- ``slow``: the last rank sleeps ``--sleep-ms`` (50) after each optimizer step, before the guard: where a blocking
  agreement makes every other rank wait for it inside the guard;
- ``jitter``: each step one rank (drawn alike on every rank) sleeps ``--sleep-ms`` / 5 before its forward and another
  as long after its optimizer step: two stragglers per step, which a second barrier per step serializes.

Rank 0 (never the slow rank) reports, per condition and way: the time its after_iter spent in the agreement's own
calls (issuing, waiting, reading: the guard's collective work on the critical path), median and mean per step (the
mean includes any step agreed at once), this thread's own CPU time in those calls (the rest is waiting: for other
ranks, or for a core), the whole after_iter, and the step; then the ratios deferred / blocking, measured in this run.

Issue 41: the replica check runs at its default interval in both ways. Per check, rank 0 reports its cost (issuing: the
digests and the asynchronous all-gather; reading it one step later: the wait and the comparison) and that cost
amortized per step; and, counted from every ``torch.distributed`` call the guard makes in after_iter, the blocking
collectives on the deferred way's steps between checks (neither a check's step nor the step that reads it), besides
those of the steps agreed at once (snapshot steps, by design): 0 is the claim. One JSON object on stdout.
"""
import argparse
import json
import os
import platform
import random
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from petr_stability.adapters.driver import GuardDriver
from petr_stability.adapters.torch_loop import TorchLoopIO
from petr_stability.core.config import GuardConfig

__all__ = ["main"]

WAYS = ("blocking", "deferred")


class AgreementClock:
    """Wraps a guard's StepAgreement calls (submit: issue; take: wait and read; now: a blocking agreement) with a clock:
    seconds spent in each since :meth:`lap`."""

    NAMES = ("submit", "take", "now")

    def __init__(self, agreement: Any) -> None:
        self.agreement = agreement
        self.spent = dict.fromkeys(self.NAMES + ("cpu",), 0.0)
        for name in self.NAMES:
            setattr(agreement, name, self._timed(name, getattr(agreement, name)))

    def _timed(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - t0
                self.spent["cpu"] += time.thread_time() - c0  # this thread's own CPU time in the call

        return timed

    def lap(self) -> Dict[str, float]:
        spent, self.spent = self.spent, dict.fromkeys(self.NAMES + ("cpu",), 0.0)
        return spent

    def set_way(self, way: str) -> None:
        """``blocking``: every step agreed at once (the guard before issue 35); ``deferred``: the guard as it is."""
        if way == "blocking":
            self.agreement.defers = lambda: False
        else:
            self.agreement.__dict__.pop("defers", None)


class CollectiveCounter:
    """Counts the ``torch.distributed`` collectives called from Python (the guard's; DDP's own all-reduce runs in C++),
    blocking or asynchronous (``async_op=True``), each once however it is built (``all_gather_object`` calls
    ``all_gather`` inside): :meth:`lap` returns the counts since the last lap."""

    NAMES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier", "gather",
             "gather_object", "reduce", "scatter", "all_to_all")

    def __init__(self) -> None:
        self.counts = {"blocking": 0, "async": 0}
        self._depth = 0
        for name in self.NAMES:
            if hasattr(dist, name):
                setattr(dist, name, self._counted(getattr(dist, name)))

    def _counted(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.counts["async" if kwargs.get("async_op") else "blocking"] += 1
            self._depth += 1
            try:
                return call(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def lap(self) -> Dict[str, int]:
        counts, self.counts = self.counts, {"blocking": 0, "async": 0}
        return counts


class ReplicaClock:
    """Wraps the guard's replica check (issue: at a check's step; conclude: the read one step later) with a clock."""

    def __init__(self, replicas: Any) -> None:
        self.spent = {"issue": 0.0, "read": 0.0}
        self.calls = {"issue": 0, "read": 0}
        for name, method in (("issue", "issue"), ("read", "conclude")):
            setattr(replicas, method, self._timed(name, getattr(replicas, method)))

    def _timed(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return timed

    def lap(self) -> Dict[str, float]:
        out = {f"replica_{k}": v for k, v in self.spent.items()}
        out.update({f"replica_{k}s": float(v) for k, v in self.calls.items()})
        self.spent, self.calls = {"issue": 0.0, "read": 0.0}, {"issue": 0, "read": 0}
        return out


class Loop:
    """One rank's DDP training under the guard, one step at a time."""

    def __init__(self, seed: int, replica_check_interval: Optional[int] = None) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
        self.ddp = nn.parallel.DistributedDataParallel(model)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.io = TorchLoopIO(model, self.opt, None, log_fn=lambda msg: None)
        guard = {} if replica_check_interval is None else {"replica_check_interval": replica_check_interval}
        self.driver = GuardDriver(GuardConfig(write_patched_config=False, **guard))  # the defaults otherwise
        self.driver.bind(self.io)
        self.driver.start()
        self.clock = AgreementClock(self.driver.guard.agreement)
        self.replica_clock = ReplicaClock(self.driver.guard.replicas)
        self.collectives = CollectiveCounter()
        self.gen = torch.Generator().manual_seed(seed)

    def step(self, before_s: float, after_s: float) -> Dict[str, float]:
        x = torch.randn(32, 64, generator=self.gen)
        t0 = time.perf_counter()
        if before_s:
            time.sleep(before_s)
        self.driver.before_iter(x)
        loss = self.ddp(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.io.clip(self.ddp.module.parameters())
        self.opt.step()
        self.io.last_loss = float(loss.detach())
        if after_s:
            time.sleep(after_s)
        self.clock.lap()
        self.replica_clock.lap()
        self.collectives.lap()
        at_once = self.driver.guard.agreement.blocking
        t1 = time.perf_counter()
        self.driver.after_iter()
        t2 = time.perf_counter()
        self.io.iter += 1
        spent = self.clock.lap()
        return {"agree": spent["submit"] + spent["take"] + spent["now"], "cpu": spent["cpu"],
                "issue": spent["submit"], "read": spent["take"],
                "after_iter": t2 - t1, "step": t2 - t0, **self.replica_clock.lap(),
                "at_once": self.driver.guard.agreement.blocking - at_once, **self.collectives.lap()}


def _sleeps(condition: str, step: int, rank: int, world: int, sleep_s: float) -> tuple:
    if condition == "slow":
        return 0.0, sleep_s if rank == world - 1 else 0.0
    if condition == "jitter":
        draw = random.Random(step)  # the same draw on every rank
        before, after = draw.randrange(world), draw.randrange(world)
        return (sleep_s / 5 if rank == before else 0.0), (sleep_s / 5 if rank == after else 0.0)
    return 0.0, 0.0


def _replicas(rows: List[Dict[str, float]], interval: int) -> Dict[str, Any]:
    """The replica check in these steps: its cost per check and amortized per step, and the blocking collectives of
    the steps between checks (neither issuing nor reading one) besides those of the steps agreed at once."""
    checks = [r for r in rows if r["replica_issues"]]
    reads = [r for r in rows if r["replica_reads"]]
    between = [r for r in rows if not r["replica_issues"] and not r["replica_reads"]]
    per_check = [r["replica_issue"] for r in checks] + [r["replica_read"] for r in reads]
    step_s = statistics.median(r["step"] for r in rows)
    cost = (sum(r["replica_issue"] for r in checks) + sum(r["replica_read"] for r in reads)) / max(1, len(checks))
    return {
        "interval": interval, "checks": len(checks), "reads": len(reads),
        "issue_us_median": statistics.median(r["replica_issue"] for r in checks) * 1e6 if checks else None,
        "read_us_median": statistics.median(r["replica_read"] for r in reads) * 1e6 if reads else None,
        "per_check_us_mean": cost * 1e6 if per_check else None,
        "amortized_ratio": cost / (interval * step_s) if checks else None,
        "steps_between_checks": len(between),
        "blocking_between_checks": sum(r["blocking"] for r in between),
        "blocking_between_checks_besides_agreed_at_once": sum(r["blocking"] for r in between if not r["at_once"]),
        "steps_agreed_at_once_between_checks": sum(1 for r in between if r["at_once"]),
        "async_between_checks": sum(r["async"] for r in between),
        "blocking_on_check_steps_besides_agreed_at_once": sum(r["blocking"] for r in checks + reads
                                                                if not r["at_once"]),
    }


def _summary(rows: List[Dict[str, float]]) -> Dict[str, float]:
    agree = [r["agree"] for r in rows]
    return {
        "steps": len(rows),
        "agree_us_median": statistics.median(agree) * 1e6,
        "agree_us_mean": statistics.mean(agree) * 1e6,
        "agree_us_p90": sorted(agree)[int(0.9 * len(agree))] * 1e6,
        "agree_cpu_us_mean": statistics.mean(r["cpu"] for r in rows) * 1e6,
        "issue_us_median": statistics.median(r["issue"] for r in rows) * 1e6,
        "issue_us_mean": statistics.mean(r["issue"] for r in rows) * 1e6,
        "read_us_median": statistics.median(r["read"] for r in rows) * 1e6,
        "read_us_mean": statistics.mean(r["read"] for r in rows) * 1e6,
        "after_iter_us_median": statistics.median(r["after_iter"] for r in rows) * 1e6,
        "step_ms_median": statistics.median(r["step"] for r in rows) * 1e3,
        "step_ms_mean": statistics.mean(r["step"] for r in rows) * 1e3,
    }


def main() -> None:
    """Runs the conditions and prints them on rank 0."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--block", type=int, default=40, help="steps per block")
    parser.add_argument("--rounds", type=int, default=3, help="blocks of each way per condition")
    parser.add_argument("--sleep-ms", type=float, default=50.0)
    parser.add_argument("--conditions", default="even,slow,jitter")
    parser.add_argument("--replica-check-interval", type=int, default=None, help="default: the guard's")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loop = Loop(seed=rank, replica_check_interval=args.replica_check_interval)
    for _ in range(5):  # warm-up: the first step is agreed at once (no snapshot yet)
        loop.step(0.0, 0.0)
    out: Dict[str, Any] = {"world_size": world, "block": args.block, "rounds": args.rounds,
                           "sleep_ms": args.sleep_ms, "torch": torch.__version__, "python": platform.python_version(),
                           "cpus": os.cpu_count(), "snapshot_interval": loop.driver.config.snapshot_interval,
                           "replica_check_interval": loop.driver.config.replica_check_interval,
                           "replica_check_on": loop.driver.guard.replicas.on}
    step_no = 0
    for condition in args.conditions.split(","):
        rows: Dict[str, List[Dict[str, float]]] = {w: [] for w in WAYS}
        at_once = 0
        for _ in range(args.rounds):
            for way in WAYS:
                loop.clock.set_way(way)
                before_block = loop.driver.guard.agreement.blocking
                for _ in range(args.block):
                    before, after = _sleeps(condition, step_no, rank, world, args.sleep_ms / 1e3)
                    rows[way].append(loop.step(before, after))
                    step_no += 1
                if way == "deferred":
                    at_once += loop.driver.guard.agreement.blocking - before_block
        blocking, deferred = _summary(rows["blocking"]), _summary(rows["deferred"])
        deferred["agreed_at_once"] = at_once  # its steps agreed at once all the same (snapshot steps)
        deferred["replica_check"] = _replicas(rows["deferred"], loop.driver.config.replica_check_interval)
        out[condition] = {
            "blocking": blocking,
            "deferred": deferred,
            "agree_ratio_median": deferred["agree_us_median"] / blocking["agree_us_median"],
            "agree_ratio_mean": deferred["agree_us_mean"] / blocking["agree_us_mean"],
            "step_ratio_median": deferred["step_ms_median"] / blocking["step_ms_median"],
        }
    loop.driver.after_epoch()  # the last step's verdict
    out["recoveries"] = loop.driver.guard.recoveries
    out["replica_counts"] = dict(loop.driver.guard.replicas.counts)
    if rank == 0:
        print(json.dumps(out, indent=1))
    dist.barrier()
    os._exit(0)  # without tearing down the gloo groups (their destructors can abort a process whose peer left)


if __name__ == "__main__":
    main()
