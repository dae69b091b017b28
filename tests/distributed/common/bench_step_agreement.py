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
One JSON object on stdout.
"""
import argparse
import json
import os
import platform
import random
import statistics
import time
from typing import Any, Callable, Dict, List

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


class Loop:
    """One rank's DDP training under the guard, one step at a time."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
        self.ddp = nn.parallel.DistributedDataParallel(model)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.io = TorchLoopIO(model, self.opt, None, log_fn=lambda msg: None)
        self.driver = GuardDriver(GuardConfig(write_patched_config=False))  # the defaults: a snapshot every 200
        self.driver.bind(self.io)
        self.driver.start()
        self.clock = AgreementClock(self.driver.guard.agreement)
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
        t1 = time.perf_counter()
        self.driver.after_iter()
        t2 = time.perf_counter()
        self.io.iter += 1
        spent = self.clock.lap()
        return {"agree": spent["submit"] + spent["take"] + spent["now"], "cpu": spent["cpu"],
                "issue": spent["submit"], "read": spent["take"],
                "after_iter": t2 - t1, "step": t2 - t0}


def _sleeps(condition: str, step: int, rank: int, world: int, sleep_s: float) -> tuple:
    if condition == "slow":
        return 0.0, sleep_s if rank == world - 1 else 0.0
    if condition == "jitter":
        draw = random.Random(step)  # the same draw on every rank
        before, after = draw.randrange(world), draw.randrange(world)
        return (sleep_s / 5 if rank == before else 0.0), (sleep_s / 5 if rank == after else 0.0)
    return 0.0, 0.0


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
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loop = Loop(seed=rank)
    for _ in range(5):  # warm-up: the first step is agreed at once (no snapshot yet)
        loop.step(0.0, 0.0)
    out: Dict[str, Any] = {"world_size": world, "block": args.block, "rounds": args.rounds,
                           "sleep_ms": args.sleep_ms, "torch": torch.__version__, "python": platform.python_version(),
                           "cpus": os.cpu_count(), "snapshot_interval": loop.driver.config.snapshot_interval}
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
        out[condition] = {
            "blocking": blocking,
            "deferred": deferred,
            "agree_ratio_median": deferred["agree_us_median"] / blocking["agree_us_median"],
            "agree_ratio_mean": deferred["agree_us_mean"] / blocking["agree_us_mean"],
            "step_ratio_median": deferred["step_ms_median"] / blocking["step_ms_median"],
        }
    loop.driver.after_epoch()  # the last step's verdict
    out["recoveries"] = loop.driver.guard.recoveries
    if rank == 0:
        print(json.dumps(out, indent=1))
    dist.barrier()
    os._exit(0)  # without tearing down the gloo groups (their destructors can abort a process whose peer left)


if __name__ == "__main__":
    main()
