"""``petr-stability demo``: one corrupted-data burst hits three fp16 runs: default, the seed's fix, guarded.

The scenario (docs/demo.md): a small PETR-shaped detector (the seed's decoder layer, PETR's AdamW lr 2e-4 /
weight decay 0.01, fp16 with a dynamic loss scale) trains on sequential frames. A few consecutive frames arrive
as raw 16-bit sensor values, their normalization skipped by a broken conversion step; saturated pixels (65535)
exceed fp16's largest value (65504) and turn into inf at the autocast. Nothing in the trigger knows about the
remedies: it is data, read in order by MMEngine's own loop.
"""
import copy
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

__all__ = ["DemoSettings", "RunResult", "RUNS", "settings_for", "corrupt_raw16", "run_demo", "format_table", "main"]

#: (key, label, what differs). Every run sees the same data, seed and trigger.
RUNS = (
    ("a", "a) default, unguarded", "dropout 0.1, max_norm 35"),
    ("b", "b) seed's fix, unguarded", "dropout 0, max_norm 1 from the start"),
    ("c", "c) default + NanGuardHook", "dropout 0.1, max_norm 35, guard on"),
)


@dataclass
class DemoSettings:
    """Size of the demo and the guard's settings (all public ``NanGuardHook`` arguments).

    Attributes:
        iters: training iterations per run.
        burst_at: 1-based iteration whose batch is the first corrupted one.
        burst_frames: consecutive corrupted frames (samples).
        batch_size: samples per iteration.
        tokens: camera tokens per sample.
        num_query: decoder queries.
        num_layers: decoder layers (each the seed's layer).
        warmup: linear warm-up iterations (PETR: ratio 1/3), then cosine.
        guard: keyword arguments of ``NanGuardHook`` for run c.
    """

    iters: int = 120
    burst_at: int = 73
    burst_frames: int = 4
    batch_size: int = 2
    tokens: int = 48
    num_query: int = 32
    num_layers: int = 2
    warmup: int = 20
    guard: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("iters", "burst_at", "batch_size", "tokens", "num_query", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.burst_frames, bool) or not isinstance(self.burst_frames, int) or self.burst_frames < 0:
            raise ValueError(f"burst_frames must be an integer >= 0, got {self.burst_frames!r}")
        if self.burst_at > self.iters:
            raise ValueError(f"burst_at={self.burst_at} is past the end of training (iters={self.iters})")


def settings_for(iters: Optional[int] = None, quick: bool = False) -> DemoSettings:
    """The demo's settings: the default (~3 min on 2 CPU cores), ``quick`` (~30 s), or ``iters`` scaled.

    The burst lands at 60% of training; the guard snapshots every ``iters // 6`` iterations and calls a
    snapshot healthy after half that many clean steps, so two confirmed states exist before the burst.
    """
    size = dict(iters=24, tokens=24, num_query=16, num_layers=1, warmup=5) if quick else dict(iters=120)
    if iters is not None:
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 12:
            raise ValueError(f"--iters must be an integer >= 12, got {iters!r}")
        size.update(iters=iters, warmup=min(size.get("warmup", 20), iters // 6))
    n = size["iters"]
    interval = max(2, n // 6)
    guard = dict(snapshot_interval=interval, confirm_steps=max(1, interval // 2), check_interval=max(1, interval // 2))
    return DemoSettings(burst_at=int(n * 0.6) + 1, guard=guard, **size)


def corrupt_raw16(x: torch.Tensor) -> torch.Tensor:
    """A normalized frame as it looks when normalization is skipped: raw 16-bit values, 65535 where saturated.

    The tokens stand for normalized pixels (mean 0, std 1); raw = 65535 * (0.5 + 0.25 * x), clamped to the
    sensor's range, so about 2% of the values sit at 65535 (> 65504, the largest fp16 number).
    """
    return (65535.0 * (0.5 + 0.25 * x)).clamp(0.0, 65535.0)


@dataclass
class RunResult:
    """What one run did, as measured."""

    key: str
    label: str
    iters_done: int = 0
    steps: int = 0
    skipped_steps: int = 0
    incidents: int = 0
    iterations_lost: int = 0
    final_loss: float = math.nan
    eval_nonfinite_pct: float = math.nan
    params_finite: bool = True
    buffers_finite: bool = True
    loss_scale: float = math.nan
    wall_s: float = 0.0
    outcome: str = "completed"
    curve: List[List[float]] = field(default_factory=list)
    incident_iters: List[int] = field(default_factory=list)


def _import_mmengine() -> Any:
    try:
        from mmengine.hooks import Hook
        from mmengine.runner import Runner
    except ImportError as exc:  # pragma: no cover - the env always has it
        raise RuntimeError("the demo needs MMEngine (pip install mmengine mmcv-lite)") from exc
    import petr_stability  # noqa: F401  (registers NanGuardHook)
    import petr_stability.testing.mmengine_cpu  # noqa: F401  (registers CPUAmpOptimWrapper, PETRLikeModel)

    return Hook, Runner


def _layer_cfg(dropout: float) -> dict:
    from petr_stability.testing.petr_like import SEED_LAYER_CFG

    cfg = copy.deepcopy(SEED_LAYER_CFG)
    for attn in cfg["attn_cfgs"]:
        attn["dropout"] = dropout
    cfg["ffn_dropout"] = dropout
    return cfg


def _make_data(s: DemoSettings) -> "tuple[list, list]":
    from petr_stability.testing.petr_like import make_batch

    # Enough frames for a guarded run that replays lost iterations on fresh data.
    n_train = 2 * s.iters * s.batch_size
    samples = make_batch(n_train + 16, tokens=s.tokens, num_query=s.num_query, seed=1)
    train, heldout = samples[:n_train], samples[n_train:]
    first = (s.burst_at - 1) * s.batch_size
    for i in range(first, first + s.burst_frames):
        train[i] = dict(train[i], inputs=corrupt_raw16(train[i]["inputs"]))
    return train, heldout


def _build_runner(key: str, work_dir: str, s: DemoSettings, train: list, progress: List[Any]) -> Any:
    _, Runner = _import_mmengine()
    from petr_stability.testing.mmengine_cpu import ListDataset

    fixed = key == "b"
    optimizer = dict(type="AdamW", lr=2e-4, weight_decay=0.01)
    if torch.cuda.is_available():
        wrapper = dict(type="AmpOptimWrapper", loss_scale="dynamic", dtype="float16")
    else:
        wrapper = dict(type="CPUAmpOptimWrapper", loss_scale="dynamic")
    wrapper.update(optimizer=optimizer, clip_grad=dict(max_norm=1 if fixed else 35, norm_type=2))
    hooks: List[Any] = list(progress)
    if key == "c":
        hooks.insert(0, dict(type="NanGuardHook", **s.guard))
    warmup = max(1, s.warmup)
    return Runner(
        model=dict(type="PETRLikeModel", num_layers=s.num_layers, num_query=s.num_query,
                   layer_cfg=_layer_cfg(0.0 if fixed else 0.1)),
        work_dir=work_dir,
        train_dataloader=dict(
            dataset=ListDataset(train),
            sampler=dict(type="DefaultSampler", shuffle=False),  # sequential frames, as StreamPETR reads them
            batch_size=s.batch_size,
            num_workers=0,
            collate_fn=dict(type="default_collate"),
        ),
        optim_wrapper=wrapper,
        param_scheduler=[
            dict(type="LinearLR", start_factor=1 / 3, by_epoch=False, begin=0, end=warmup),
            dict(type="CosineAnnealingLR", by_epoch=False, begin=warmup, end=s.iters, eta_min=2e-7),
        ],
        train_cfg=dict(by_epoch=False, max_iters=s.iters),
        default_hooks=dict(
            checkpoint=dict(type="CheckpointHook", interval=s.iters, by_epoch=False, max_keep_ckpts=1),
            logger=dict(type="LoggerHook", interval=5),
        ),
        log_processor=dict(by_epoch=False),
        custom_hooks=hooks,
        default_scope="mmengine",
        randomness=dict(seed=0),
        log_level="ERROR",
    )


def _progress_hooks(result: RunResult, work_dir: str, total: int, echo: bool) -> List[Any]:
    """A meter that reads each step before NanGuardHook acts on it, and a printer that runs after it."""
    Hook, _ = _import_mmengine()
    from petr_stability.core.incidents import read_incidents

    every = max(1, total // 10)
    t0 = time.perf_counter()

    class _Meter(Hook):
        priority = "ABOVE_NORMAL"  # before NanGuardHook (NORMAL): sees the step as it happened

        def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
            loss = float(outputs["loss"]) if outputs and "loss" in outputs else math.nan
            hub = runner.message_hub
            grad = hub.get_scalar("train/grad_norm").current() if "train/grad_norm" in hub.log_scalars else 0.0
            scaler = getattr(runner.optim_wrapper, "loss_scaler", None)
            scale = float(scaler.get_scale()) if scaler is not None else math.nan
            model = runner.model.module if hasattr(runner.model, "module") else runner.model
            finite = _finite(list(model.parameters())) and _finite(list(model.buffers()))
            result.steps += 1
            result.skipped_steps += 0 if math.isfinite(grad) else 1
            result.curve.append([runner.iter + 1, loss, scale, 1.0 if finite else 0.0])

    class _Printer(Hook):
        priority = "LOW"  # after NanGuardHook: a rollback is already visible

        def __init__(self) -> None:
            self.seen = 0

        def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
            records = read_incidents(work_dir)
            for rec in records[self.seen:]:
                result.incident_iters.append(int(rec.get("iteration", 0)))
                if echo:
                    back = rec.get("restored_from") or {}
                    where = (f"rolled back to iter {int(back['iteration']) + 1}, "
                             f"{rec.get('iterations_lost', 0)} iteration(s) lost" if back else rec.get("event", ""))
                    print(f"    ! guard: incident at iter {rec.get('iteration')}: {rec.get('reason')}; {where}; "
                          f"{len(rec.get('actions', []))} setting(s) changed", flush=True)
            self.seen = len(records)
            now = runner.iter + 1
            if echo and (now % every == 0 or now == total) and result.curve:
                _, loss, scale, finite = result.curve[-1]
                print(f"  {result.key}) iter {now:>4}/{total}  loss {loss:6.3f}  loss scale {scale:>7g}  "
                      f"skipped steps {result.skipped_steps:>2}  state {'finite' if finite else 'NON-FINITE'}  "
                      f"incidents {self.seen}  {time.perf_counter() - t0:5.1f}s", flush=True)

    return [_Meter(), _Printer()]


def _finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _eval_nonfinite(model: torch.nn.Module, heldout: list) -> float:
    """Percent of non-finite decoder outputs on clean held-out frames in eval mode, before PETR's nan_to_num.

    In eval mode BatchNorm normalizes with its running statistics, as at test time; the head's nan_to_num
    would turn NaN predictions into zeros, so the decoder layer's own output is read.
    """
    layers = [m for m in model.modules() if type(m).__name__ == "PETRLikeDecoderLayer"]
    seen: List[torch.Tensor] = []
    handle = layers[-1].register_forward_hook(lambda m, i, out: seen.append(out.detach()))
    device = next(model.parameters()).device
    inputs = torch.stack([x["inputs"] for x in heldout]).to(device)
    cls_t = torch.stack([x["cls_t"] for x in heldout]).to(device)
    reg_t = torch.stack([x["reg_t"] for x in heldout]).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(inputs, cls_t, reg_t)
    finally:
        handle.remove()
        model.train(was_training)
    out = seen[-1]
    return 100.0 * float((~torch.isfinite(out)).float().mean())


def _run_one(key: str, label: str, root: str, s: DemoSettings, train: list, heldout: list,
             echo: bool) -> RunResult:
    from petr_stability.core.errors import NanGuardError
    from petr_stability.core.incidents import read_incidents

    work_dir = os.path.join(root, {"a": "a_default", "b": "b_seed_fix", "c": "c_guarded"}[key])
    if os.path.isdir(work_dir):
        shutil.rmtree(work_dir)  # the demo's own output of an earlier run: the report must see this run only
    result = RunResult(key, label)
    t0 = time.perf_counter()
    runner = _build_runner(key, work_dir, s, train, _progress_hooks(result, work_dir, s.iters, echo))
    try:
        runner.train()
    except NanGuardError as exc:
        result.outcome = f"guard gave up: {type(exc).__name__}"
    result.wall_s = time.perf_counter() - t0
    model = runner.model.module if hasattr(runner.model, "module") else runner.model
    records = read_incidents(work_dir)
    result.iters_done = int(runner.iter)
    result.incidents = sum(1 for r in records if r.get("event") in ("divergence", "stalled"))
    result.iterations_lost = sum(int(r.get("iterations_lost") or 0) for r in records)
    tail = [c[1] for c in result.curve[-10:]]
    result.final_loss = sum(tail) / len(tail) if tail else math.nan
    result.params_finite = _finite(list(model.parameters()))
    result.buffers_finite = _finite(list(model.buffers()))
    result.eval_nonfinite_pct = _eval_nonfinite(model, heldout)
    scaler = getattr(runner.optim_wrapper, "loss_scaler", None)
    result.loss_scale = float(scaler.get_scale()) if scaler is not None else math.nan
    return result


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def format_table(results: Sequence[RunResult], iters: int) -> str:
    """The comparison table, one row per run."""
    head = (f"{'run':<27} {'iters done':>10} {'skipped':>7} {'incidents':>9} {'lost':>5} {'final loss':>10} "
            f"{'weights finite':>14} {'BN stats finite':>15} {'eval NaN out':>12} {'scale':>7} {'time':>7}  outcome")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.label:<27} {f'{r.iters_done}/{iters}':>10} {r.skipped_steps:>7} {r.incidents:>9} "
            f"{r.iterations_lost:>5} {r.final_loss:>10.3f} {_yes(r.params_finite):>14} "
            f"{_yes(r.buffers_finite):>15} {f'{r.eval_nonfinite_pct:.0f}%':>12} {r.loss_scale:>7g} {r.wall_s:>6.1f}s"
            f"  {r.outcome}"
        )
    return "\n".join(lines)


def _plot(results: Sequence[RunResult], s: DemoSettings, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"a": "tab:red", "b": "tab:orange", "c": "tab:blue"}
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, gridspec_kw=dict(height_ratios=[3, 1.3]))
    burst_end = s.burst_at + (max(1, s.burst_frames) - 1) // s.batch_size
    for a in (ax, ax2):
        a.axvspan(s.burst_at - 0.5, burst_end + 0.5, color="grey", alpha=0.25, lw=0)
    for r in results:
        marked = False
        # Split the curve where a rollback set the counter back: the abandoned part is drawn faded.
        segments: List[List[List[float]]] = [[]]
        for point in r.curve:
            if segments[-1] and point[0] <= segments[-1][-1][0]:
                segments.append([])
            segments[-1].append(point)
        for i, seg in enumerate(segments):
            final = i == len(segments) - 1
            xs = [p[0] for p in seg]
            window = 8
            ys = []
            for j in range(len(seg)):
                vals = [p[1] for p in seg[max(0, j - window + 1): j + 1] if math.isfinite(p[1])]
                ys.append(sum(vals) / len(vals) if vals else math.nan)
            style = dict(color=colors[r.key], alpha=1.0 if final else 0.35, ls="-" if final else "--")
            ax.plot(xs, ys, label=r.label if i == 0 else None, **style)
            ax2.plot(xs, [max(p[2], 1e-30) for p in seg], **style)
            bad = [p for p in seg if not p[3]]
            if bad:
                ax.plot([bad[0][0]], [ys[seg.index(bad[0])]], marker="X", ms=11, color=colors[r.key],
                        alpha=style["alpha"], ls="none", label=None if marked else f"{r.key}) state turns non-finite")
                marked = True
        for it in r.incident_iters:
            ax.axvline(it, color=colors[r.key], ls=":", lw=1.5)
    ax.set_ylabel(f"training loss (mean of {8})")
    ax.set_title("Same corrupted frames (grey band) hit all three fp16 runs. X: weights/BN statistics turn "
                 "non-finite;\ndotted: guard incidents; dashed: work the guard rolled back", fontsize=9)
    ax.legend(loc="upper right", fontsize=8)
    ax2.set_yscale("log", base=2)
    ax2.set_ylabel("loss scale")
    ax2.set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(work_dir: str = "work_dirs/demo", iters: Optional[int] = None, quick: bool = False,
             echo: bool = True) -> List[RunResult]:
    """Runs the three runs one after the other, prints the table, writes ``demo.png`` and ``summary.json``.

    Args:
        work_dir: parent of the three runs' work dirs. Defaults to ``work_dirs/demo``.
        iters: training iterations per run (>= 12). Defaults to 120 (30 with ``quick``).
        quick: the ~30 s variant (one decoder layer, fewer tokens and queries). Defaults to False.
        echo: print progress and the table. Defaults to True.

    Returns:
        One :class:`RunResult` per run, in the order a, b, c.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch/MMCV deprecation chatter would bury the progress lines
        return _run_demo(work_dir, settings_for(iters, quick), echo)


def _run_demo(work_dir: str, s: DemoSettings, echo: bool) -> List[RunResult]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if echo:
        print(f"petr-stability demo: {s.iters} iterations per run on {device}, fp16 autocast + dynamic loss scale, "
              f"AdamW lr 2e-4 wd 0.01, batch {s.batch_size}, {s.num_layers} seed decoder layer(s).")
        first = (s.burst_at - 1) * s.batch_size
        print(f"Trigger: frames {first}..{first + s.burst_frames - 1} (iteration {s.burst_at} on) "
              "arrive as raw 16-bit values (normalization skipped); saturated pixels (65535) exceed fp16's max 65504.")
        print("Guard (run c): NanGuardHook(" + ", ".join(f"{k}={v}" for k, v in s.guard.items())
              + "), every other argument at its default.")
    os.makedirs(work_dir, exist_ok=True)
    train, heldout = _make_data(s)
    results = []
    for key, label, what in RUNS:
        if echo:
            print(f"\n{label}: {what}", flush=True)
        results.append(_run_one(key, label, work_dir, s, train, heldout, echo))
    plot_path = os.path.join(work_dir, "demo.png")
    _plot(results, s, plot_path)
    summary = dict(settings=asdict(s), device=device,
                   runs=[{k: v for k, v in asdict(r).items() if k != "curve"} for r in results])
    with open(os.path.join(work_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    if echo:
        print("\n" + format_table(results, s.iters))
        print("\nfinal loss: mean training loss of the last 10 steps (PETR's nan_to_num keeps it finite even when the "
              "model is poisoned).\neval NaN out: share of non-finite decoder outputs on clean held-out frames in "
              "eval mode, read before nan_to_num\n(BatchNorm then uses its running statistics, as at test time).")
        dirs = [os.path.join(work_dir, d) for d in ("a_default", "b_seed_fix", "c_guarded")]
        print(f"plot: {plot_path}\nwork dirs: {', '.join(dirs)}\nnext: petr-stability report {dirs[-1]}")
    return results


def main(args: Any) -> int:
    """Entry point of ``petr-stability demo`` (``args`` from :mod:`petr_stability.cli`)."""
    run_demo(args.work_dir, iters=args.iters, quick=args.quick)
    return 0
