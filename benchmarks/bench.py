"""Costs of the guard, each a ratio measured in one process with interleaved trials (CPU, unchanged on CUDA).

    python benchmarks/bench.py [--device cpu|cuda] [--size small|large] [--json out.json]

The model is framework-free (torch's own transformer decoder at PETR's head size: 256 dims, 8 heads, FFN 2048,
dropout 0.1, 900 queries on 'large'), so the script runs wherever torch does. Figures printed:

1. healthy-step overhead of the guard vs the same loop without it (interleaved blocks; target <= 1%);
2. snapshot cost amortized per iteration at the default interval, its host memory, and how much of the copy
   the training loop waits for (on CUDA the copies are asynchronous into pinned memory);
3. the health check vs one plain read pass over the same tensors, and vs per-tensor boolean masks;
4. rollback latency vs the raw copy time of the same state (target within 2x);
5. iterations lost per incident, per class of incident, at the defaults, with the real snapshot ring and stability
   band, vs PETR's default checkpoint interval (one epoch);
6. on CUDA: host-device synchronizations the guard adds to a healthy step (torch.cuda.set_sync_debug_mode);
7. the replica check's own work on one rank (issue 41; under a process group only): the digests of every parameter and
   in-step buffer on the device and their one copy to the host, per check for both sizes' models, and amortized per
   step at the default interval (the all-gather across ranks and its read: tests/distributed/common/
   bench_step_agreement.py).
"""
import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import torch
from torch import nn

from petr_stability.adapters.torch_loop import TorchLoopIO
from petr_stability.core.config import GuardConfig
from petr_stability.core.flags import make_grad_scaler
from petr_stability.core.guard import NanGuard
from petr_stability.core.port import Payload
from petr_stability.core.recovery.snapshot import Snapshot, SnapshotRing, copies_done, copy_to_host
from petr_stability.core.tree import iter_tensors
from petr_stability.core.tree import nbytes as payload_nbytes
from petr_stability.core.watch.detector import DivergenceDetector, StepSignals, Verdict
from petr_stability.core.watch.health import all_finite, model_tensors, optimizer_tensors
from petr_stability.core.watch.replicas import digests, replicated_tensors
from petr_stability.core.watch.spikes import StabilityWatch
from petr_stability.testing.reads import cuda_syncs as record_syncs

SIZES = {
    "small": dict(layers=2, queries=128, memory=256, batch=1),
    "large": dict(layers=6, queries=900, memory=4000, batch=2),
}


class Decoder(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(256, 8, 2048, dropout=0.1)
        self.decoder = nn.TransformerDecoder(layer, layers)
        self.cls = nn.Linear(256, 10)
        self.reg = nn.Linear(256, 10)

    def forward(self, q: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        out = torch.nan_to_num(self.decoder(q, mem))
        return self.cls(out).float().pow(2).mean() + self.reg(out).float().abs().mean()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Bench:
    def __init__(self, device: str, size: str) -> None:
        self.device = device
        self.size = size
        self.cfg = SIZES[size]
        torch.manual_seed(0)
        self.model = Decoder(self.cfg["layers"]).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=2e-4, weight_decay=0.01)
        # fp16 autocast on CUDA (PETR's setting); fp32 on CPU, where fp16 kernels are slow and unrepresentative.
        # The guard's own costs do not depend on the forward's dtype.
        self.amp = device == "cuda"
        self.scaler = make_grad_scaler(device, enabled=self.amp)
        b, q, m = self.cfg["batch"], self.cfg["queries"], self.cfg["memory"]
        self.q = torch.randn(q, b, 256, device=device)
        self.mem = torch.randn(m, b, 256, device=device)
        self.io = TorchLoopIO(self.model, self.opt, self.scaler, {"max_norm": 35.0, "norm_type": 2}, None,
                              log_fn=lambda msg: None)
        # Periodic check at its default; snapshots measured on their own (item 2).
        self.guard = NanGuard(GuardConfig(snapshot_interval=10 ** 9, restore_from_checkpoints=False), self.io)
        self.guard.points.ring.add(Snapshot(-1, 0, {}, clean_steps=10 ** 9))  # the ring is not empty: no first snapshot
        self.guard_seconds = 0.0
        self.guard_calls = 0

    def step(self, guarded: bool) -> None:
        with torch.autocast(self.device, dtype=torch.float16, enabled=self.amp):
            loss = self.model(self.q, self.mem)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        if guarded:
            norm = self.io.clip(self.model.parameters())
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 35.0)
        grad_norm = float(norm)  # what the runners log, guarded or not (one sync either way)
        self.scaler.step(self.opt)
        self.scaler.update()
        if guarded:
            self.io.last_loss = float(loss.detach())
            t0 = time.perf_counter()
            self.guard.after_iter()
            self.guard_seconds += time.perf_counter() - t0
            self.guard_calls += 1
            self.io.iter += 1
        else:
            _ = float(loss.detach())  # the runners read the loss for logging either way
        del grad_norm

    def block(self, guarded: bool, n: int) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(n):
            self.step(guarded)
        sync(self.device)
        return (time.perf_counter() - t0) / n


def median_time(fn: Callable[[], Any], device: str, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def overhead(b: Bench, rounds: int, block: int) -> Dict[str, float]:
    for _ in range(3):
        b.step(False)
        b.step(True)
    base, guard = [], []
    for r in range(rounds):  # alternate the order, so drift hits both equally
        order = (False, True) if r % 2 == 0 else (True, False)
        for guarded in order:
            (guard if guarded else base).append(b.block(guarded, block))
    step_s, guard_s = statistics.median(base), statistics.median(guard)
    self_s = b.guard_seconds / max(1, b.guard_calls)
    return {"step_seconds": step_s, "guarded_step_seconds": guard_s, "overhead_ratio": guard_s / step_s - 1,
            "guard_self_seconds": self_s, "guard_self_ratio": self_s / step_s}


def snapshot_cost(b: Bench, step_s: float) -> Dict[str, float]:
    ring = SnapshotRing(keep=3, confirm_steps=0)
    pin = b.device == "cuda"

    def take() -> Snapshot:  # as the guard takes one: pinned buffers, non-blocking copies, no host wait
        payload = copy_to_host(b.io.capture(), reuse=ring.recyclable(), pin=pin)
        snap = Snapshot(0, 0, payload, nbytes=payload_nbytes(payload), copied=copies_done(pin))
        ring.add(snap)
        return snap

    t = median_time(take, b.device)  # until the copies have landed
    host = []  # what the training loop itself waits: until take() returns
    for _ in range(5):
        sync(b.device)
        t0 = time.perf_counter()
        take()
        host.append(time.perf_counter() - t0)
        sync(b.device)
    nbytes = ring.snapshots[-1].nbytes
    param_bytes = sum(p.numel() * p.element_size() for p in b.model.parameters())
    return {"snapshot_seconds": t, "snapshot_host_seconds": statistics.median(host),
            "host_wait_vs_copy": statistics.median(host) / t, "snapshot_bytes": nbytes,
            "snapshot_bytes_per_param_byte": nbytes / param_bytes, "host_bytes_3_snapshots": 3 * nbytes,
            "interval": GuardConfig().snapshot_interval,
            "amortized_ratio": t / (GuardConfig().snapshot_interval * step_s)}


def health_cost(b: Bench) -> Dict[str, float]:
    tensors = model_tensors(b.model) + optimizer_tensors(b.opt)

    def fused() -> None:
        all_finite(tensors)

    def copy_pass() -> None:  # a memory-bandwidth yardstick: read (and write) every byte once
        for t in tensors:
            t.clone()

    def masks() -> None:  # the naive way: a boolean mask and a host read per tensor
        all(bool(torch.isfinite(t).all()) for t in tensors)

    tf, tc, tm = (median_time(f, b.device) for f in (fused, copy_pass, masks))
    return {"check_seconds": tf, "copy_pass_seconds": tc, "check_vs_copy_pass": tf / tc, "masks_vs_check": tm / tf}


def rollback_cost(b: Bench) -> Dict[str, float]:
    payload = copy_to_host(b.io.capture(), pin=b.device == "cuda")
    sync(b.device)
    live = [t for t in b.model.state_dict().values() if t.is_floating_point()] + optimizer_tensors(b.opt)
    saved = [t for t in payload["state_dict"].values() if t.is_floating_point()]
    saved += list(iter_tensors(list(payload["optimizer"]["state"].values())))

    def restore() -> None:
        b.io.restore(Payload(payload, 0, 0))

    def raw() -> None:
        for dst, src in zip(live, saved):
            dst.copy_(src, non_blocking=True)

    tr, tc = median_time(restore, b.device), median_time(raw, b.device)
    return {"restore_seconds": tr, "raw_copy_seconds": tc, "restore_vs_raw_copy": tr / tc}


def _skips_until_divergence(cfg: GuardConfig) -> int:
    """Skipped steps the real detector takes to call a streak a divergence at the defaults (the scale halving from
    where the gradients fitted it): how far after the trouble started the guard acts."""
    detector = DivergenceDetector(cfg.detector)
    scale = 65536.0
    for it in range(1, 50):  # a healthy stretch: the scaler has fitted the gradients
        detector.observe(StepSignals(it, True, 1.0, 1.0, scale, "dynamic", True))
    skips = 0
    while True:
        skips += 1
        scale /= 2
        decision = detector.observe(StepSignals(50 + skips, True, math.inf, 1.0, scale, "dynamic", False))
        if decision.verdict == Verdict.DIVERGED:
            return skips


def _ring_until(cfg: GuardConfig, fault: int, trouble: int, watch: StabilityWatch, rng: random.Random) -> SnapshotRing:
    """The real ring over the iterations before ``fault`` at ``cfg``'s interval: stable steps, then (from ``trouble``
    on, if before the fault) a loss explosion the real :class:`StabilityWatch` judges, growing 1.2-2x per step."""
    ring = SnapshotRing(cfg.keep_snapshots, cfg.confirm_steps)
    growth, loss = rng.uniform(1.2, 2.0), 1.0
    for it in range(max(1, fault - 6 * cfg.snapshot_interval), fault):
        if it >= trouble:
            loss *= growth
        value = loss * math.exp(rng.gauss(0, 0.1))
        grad_norm = 2.0 * math.exp(rng.gauss(0, 0.5)) * (loss if it >= trouble else 1.0)
        unstable = watch.judge(value, grad_norm) is not None
        watch.update(value, grad_norm, unstable, it)
        ring.tick(stable=not unstable)
        if it % cfg.snapshot_interval == 0:
            ring.add(Snapshot(it, 0, {}))
    return ring


def iterations_lost(trials: int = 300, epoch_iters: int = 28130 // 8, **guard: Any) -> Dict[str, Any]:
    """Iterations lost per incident at the defaults, per class of incident, with the real snapshot ring, the real
    stability band and the real detector (and no more snapshots than ``keep_snapshots``):

    - seen as it happens (NaN weights, a divergence with nothing before it): back to the newest confirmed snapshot;
    - a loss explosion first (a too-high rate): the band calls its steps unstable from the first one out of it, so the
      newest confirmed snapshot is one from before it; the explosion lasts 5-30 steps before the divergence;
    - a skip streak classed bad data or a forward overflow the healthy weights show too: back to where it started
      (the detector fires at the streak's fifth skip);
    - a skip streak classed dynamics, or a forward overflow the weights grew into: confirmed states only: the newest
      confirmed, the streak later.
    """
    cfg = GuardConfig(**guard)
    rng = random.Random(0)
    streak = _skips_until_divergence(cfg)
    lost: Dict[str, List[int]] = {k: [] for k in ("as_it_happens", "explosion", "streak_data", "streak_dynamics")}
    held, ckpt = [], []
    for _ in range(trials):
        fault = rng.randrange(epoch_iters, 6 * epoch_iters)
        watch = StabilityWatch(cfg.stability_window, cfg.stability_z, cfg.stability_ratio, cfg.stability_warmup)
        ring = _ring_until(cfg, fault, fault, watch, rng)
        lost["as_it_happens"].append(fault - ring.newest_confirmed().iteration)
        lost["streak_dynamics"].append(fault - ring.newest_confirmed().iteration)  # the streak's skips do not tick
        ring.add(Snapshot(fault - streak, 0, {}, at_trouble=True))  # the streak's first skip, into the ring
        held.append(len(ring))
        lost["streak_data"].append(fault - [s for s in ring.snapshots if s.at_trouble][-1].iteration)
        watch = StabilityWatch(cfg.stability_window, cfg.stability_z, cfg.stability_ratio, cfg.stability_warmup)
        explosion = _ring_until(cfg, fault, fault - rng.randint(5, 30), watch, rng)
        lost["explosion"].append(fault - explosion.newest_confirmed().iteration)
        held.append(len(explosion))
        ckpt.append(fault % epoch_iters + 1)  # back to the last per-epoch checkpoint
    out: Dict[str, Any] = {k: {"mean": statistics.mean(v), "max": max(v)} for k, v in lost.items()}
    out.update(snapshots_held_max=max(held), keep_snapshots=cfg.keep_snapshots, snapshot_interval=cfg.snapshot_interval,
               confirm_steps=cfg.confirm_steps, mean_lost_epoch_checkpoint=statistics.mean(ckpt),
               worst_mean=max(statistics.mean(v) for v in lost.values()))
    return out


def replica_check_cost(b: Bench, step_s: float) -> Dict[str, Any]:
    """A replica check's work on one rank, per check, for this size's model and the other size's (the other's step is
    not measured here: its amortized figure is against this one's step x its parameter ratio)."""
    interval = GuardConfig().replica_check_interval
    out: Dict[str, Any] = {"interval": interval}
    for size in sorted(SIZES):
        model = b.model if size == b.size else Decoder(SIZES[size]["layers"]).to(b.device)
        tensors = [t for _, t in replicated_tensors(model)]

        def copy_pass(tensors: List[torch.Tensor] = tensors) -> None:
            for t in tensors:
                t.clone()

        check = median_time(lambda tensors=tensors: digests(tensors), b.device)
        out[size] = {"params": sum(p.numel() for p in model.parameters()), "tensors": len(tensors),
                     "check_seconds": check, "check_vs_copy_pass": check / median_time(copy_pass, b.device)}
    out["amortized_ratio"] = out[b.size]["check_seconds"] / (interval * step_s)
    return out


def cuda_syncs(b: Bench, steps: int = 20) -> Dict[str, Any]:
    # Count only what the guard adds: its after_iter on healthy steps between periodic checks.
    counted = 0
    for _ in range(steps):
        b.step(False)
        if (b.io.iter + 1) % b.guard.config.check_interval == 0:
            b.io.iter += 1
        norm = b.io.clip(b.model.parameters())
        b.io.last_loss = 1.0
        float(norm)
        with record_syncs() as found:
            b.guard.after_iter()
        counted += len(found)
        b.io.iter += 1
    return {"healthy_steps": steps, "syncs_added": counted}


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=sorted(SIZES), default=None)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=50, help="steps per timed block (one periodic check each)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    size = a.size or ("large" if a.device == "cuda" else "small")
    b = Bench(a.device, size)
    res: Dict[str, Any] = {
        "machine": {"device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu",
                    "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": sys.version.split()[0], "size": size, **SIZES[size],
                    "params": sum(p.numel() for p in b.model.parameters())},
    }
    res["overhead"] = overhead(b, a.rounds, a.block)
    res["snapshot"] = snapshot_cost(b, res["overhead"]["step_seconds"])
    res["health_check"] = health_cost(b)
    res["rollback"] = rollback_cost(b)
    res["iterations_lost"] = iterations_lost()
    res["replica_check"] = replica_check_cost(b, res["overhead"]["step_seconds"])
    if a.device == "cuda":
        res["cuda_syncs"] = cuda_syncs(b)
    o, s, h, r, lo = (res[k] for k in ("overhead", "snapshot", "health_check", "rollback", "iterations_lost"))
    print(f"machine: {res['machine']}")
    print(f"1. healthy-step overhead: {100 * o['overhead_ratio']:+.2f}% end to end, interleaved "
          f"(step {1e3 * o['step_seconds']:.1f} ms, guarded {1e3 * o['guarded_step_seconds']:.1f} ms); the guard's "
          f"own time {1e3 * o['guard_self_seconds']:.3f} ms = {100 * o['guard_self_ratio']:.3f}% of a step")
    print(f"2. snapshot: {1e3 * s['snapshot_seconds']:.1f} ms, amortized at the default interval "
          f"({s['interval']}): {100 * s['amortized_ratio']:.3f}% of a step; {s['snapshot_bytes'] / 2**20:.1f} MiB each "
          f"({s['snapshot_bytes_per_param_byte']:.1f}x the weights), "
          f"3 kept: {s['host_bytes_3_snapshots'] / 2**20:.1f} MiB; the loop waits "
          f"{1e3 * s['snapshot_host_seconds']:.1f} ms of it ({s['host_wait_vs_copy']:.2f}x)")
    print(f"3. health check: {1e3 * h['check_seconds']:.1f} ms = {h['check_vs_copy_pass']:.2f}x one copy of the same "
          f"tensors; per-tensor masks cost "
          f"{h['masks_vs_check']:.2f}x the fused check")
    print(f"4. rollback: {1e3 * r['restore_seconds']:.1f} ms = {r['restore_vs_raw_copy']:.2f}x the raw copy")
    print(f"5. iterations lost per incident at the defaults (snapshot_interval {lo['snapshot_interval']}, "
          f"confirm_steps {lo['confirm_steps']}), mean (max): seen as it happens {lo['as_it_happens']['mean']:.0f} "
          f"({lo['as_it_happens']['max']}); after a loss explosion {lo['explosion']['mean']:.0f} "
          f"({lo['explosion']['max']}); a skip streak classed data or forward overflow {lo['streak_data']['mean']:.0f} "
          f"({lo['streak_data']['max']}), classed dynamics {lo['streak_dynamics']['mean']:.0f} "
          f"({lo['streak_dynamics']['max']}); vs {lo['mean_lost_epoch_checkpoint']:.0f} back to a per-epoch "
          f"checkpoint; at most {lo['snapshots_held_max']} of keep_snapshots={lo['keep_snapshots']} snapshots held")
    rc = res["replica_check"]
    print(f"7. replica check (one rank's work, every {rc['interval']} iterations): "
          + "; ".join(f"{k} model ({rc[k]['params'] / 1e6:.2f} M params, {rc[k]['tensors']} tensors) "
                      f"{1e3 * rc[k]['check_seconds']:.2f} ms = {rc[k]['check_vs_copy_pass']:.2f}x one copy"
                      for k in sorted(SIZES))
          + f"; amortized: {100 * rc['amortized_ratio']:.3f}% of a {size} step")
    if "cuda_syncs" in res:
        print(f"6. CUDA syncs added per healthy step: {res['cuda_syncs']['syncs_added']} "
              f"over {res['cuda_syncs']['healthy_steps']} steps")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2, default=lambda v: v if not isinstance(v, float) or math.isfinite(v) else str(v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
