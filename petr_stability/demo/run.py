"""``petr-stability demo``: fp16 runs of a PETR-shaped detector into a real fault, unguarded, fixed and guarded.

Two scenarios (docs/demo.md), each a few real MMEngine runs on the same data and seed:

- ``dynamics`` (the headline): nothing is planted. The learning rate is far above what this model tolerates
  (a learning rate copied from a recipe without scaling it to the run), the attention logits grow step by step
  until fp16 overflows in the forward pass; every step is then skipped by the dynamic loss scale.
- ``data_burst``: a few consecutive frames arrive as raw 16-bit sensor values (normalization skipped); saturated
  pixels (65535) exceed fp16's largest value (65504), turn into inf at the autocast, and BatchNorm's running
  statistics become NaN while the logged loss stays finite.
"""
import copy
import json
import math
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["SCENARIOS", "RUNS", "BENCHMARK_RUNS", "DemoSettings", "RunResult", "settings_for", "corrupt_raw16",
           "run_demo", "format_table", "summary_dict"]

#: Scenario names, in the order ``petr-stability demo`` runs them.
SCENARIOS = ("dynamics", "data_burst")

#: key -> (label, what differs). Every run of a scenario sees the same data and seed.
RUNS = {
    "unguarded": ("unguarded (default)", "transformer dropout 0.1, max_norm 35"),
    "known_fix": ("known fix, unguarded", "the known manual fix (transformer dropout 0, max_norm 1) from the start"),
    "guarded": ("default + NanGuardHook", "dropout 0.1, max_norm 35, NanGuardHook on"),
    "reference": ("reference (stable lr)", "dropout 0.1, max_norm 35, the stable learning rate"),
    "reshuffled": ("reference, later frames", "the reference on the frame stream a third of a run further on (other "
                                              "frames of the same data: a rollback's replayed iterations see them)"),
    "remedied": ("guard's answer from the start", "the guard's answer to the dynamics overflow from the first "
                                                  "iteration, no guard: the decoder layers in fp32, the rate x "
                                                  "overflow_lr_backoff (the best that answer can end)"),
    "adaptive_clip": ("guarded + adaptive clip", "dropout 0.1, max_norm 35, NanGuardHook(remedies=[dict(type="
                                                 "'adaptive_clip')]): clipped at min(35, mean + z*std)"),
}

#: Runs ``benchmarks/efficacy.py`` asks for and the demo itself does not make.
BENCHMARK_RUNS = ("reshuffled", "remedied")

#: The smallest ``--iters``: the guarded data_burst run recovers from here on (measured; 12 gives up).
MIN_ITERS = 24

# A learning rate this model does not tolerate under fp16, and one it does (docs/demo.md has the sweep). The high one
# was chosen by the unguarded runs alone: at 1e-1 every one of seeds 0-4 is lost natively (AVX-512) and under
# ATEN_CPU_CAPABILITY=default, stalled and with a NaN held-out loss; at 6.5e-2 (before) one of the ten was not.
DYNAMICS_LR = 1e-1
PETR_LR = 2e-4
STABLE_LR = PETR_LR


@dataclass
class DemoSettings:
    """One scenario's size, optimizer and the guard's settings (all public ``NanGuardHook`` arguments).

    Attributes:
        scenario: ``'dynamics'`` or ``'data_burst'``.
        iters: training iterations per run.
        lr: peak AdamW learning rate of every run but ``reference``.
        reference_lr: peak learning rate of the ``reference`` run.
        runs: run keys (:data:`RUNS`), in order.
        burst_at: 1-based iteration whose batch is the first corrupted one (0: no corrupted frames).
        burst_frames: consecutive corrupted frames (samples).
        batch_size: samples per iteration.
        tokens: camera tokens per sample.
        num_query: decoder queries.
        num_layers: decoder layers (each the PETR decoder layer).
        warmup: linear warm-up iterations (PETR: from 1/3), then cosine.
        seed: the runner's seed (weights, dropout); the frames are drawn with ``seed + 1``.
        guard: keyword arguments of ``NanGuardHook`` for the ``guarded`` run.
        adaptive: further ``NanGuardHook`` arguments of the ``adaptive_clip`` run (the guarded run's plus
            ``remedies=[dict(type='adaptive_clip')]`` and the grad_norm window it clips from).
    """

    scenario: str = "data_burst"
    iters: int = 60
    lr: float = PETR_LR
    reference_lr: float = PETR_LR
    runs: Tuple[str, ...] = ("unguarded", "known_fix", "guarded")
    burst_at: int = 0
    burst_frames: int = 0
    batch_size: int = 2
    tokens: int = 24
    num_query: int = 16
    num_layers: int = 1
    warmup: int = 10
    seed: int = 0
    guard: Dict[str, Any] = field(default_factory=dict)
    adaptive: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario must be one of {list(SCENARIOS)}, got {self.scenario!r}")
        for name in ("iters", "batch_size", "tokens", "num_query", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("burst_at", "burst_frames", "warmup", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.burst_at > self.iters:
            raise ValueError(f"burst_at={self.burst_at} is past the end of training (iters={self.iters})")
        unknown = [k for k in self.runs if k not in RUNS]
        if unknown:
            raise ValueError(f"unknown run {unknown[0]!r}; choose from {list(RUNS)}")


def _guard_settings(n: int) -> Dict[str, int]:
    interval = max(2, n // 6)
    return dict(snapshot_interval=interval, confirm_steps=max(1, interval // 2), check_interval=max(1, interval // 2))


def settings_for(scenario: str = "data_burst", iters: Optional[int] = None, quick: bool = False) -> DemoSettings:
    """A scenario's settings: the default, ``quick`` (the test's size), or ``iters`` iterations.

    The guard snapshots every ``iters // 6`` iterations and calls a snapshot healthy after half that many clean
    steps (its defaults, 200/50, are sized for runs of tens of thousands of iterations). In ``data_burst`` the
    burst lands at 60% of training, so two confirmed states exist before it.

    Args:
        scenario: ``'dynamics'`` or ``'data_burst'``. Defaults to ``'data_burst'``.
        iters: iterations per run (>= 24). Defaults to None (the scenario's own: 100 dynamics, 60 data_burst).
        quick: the test's size (24 iterations). Defaults to False.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"--scenario must be one of {list(SCENARIOS)} or 'all', got {scenario!r}")
    if iters is not None and (isinstance(iters, bool) or not isinstance(iters, int) or iters < MIN_ITERS):
        raise ValueError(f"--iters must be an integer >= {MIN_ITERS}, got {iters!r}")
    n = iters if iters is not None else (24 if quick else (100 if scenario == "dynamics" else 60))
    warmup = min(10, n // 6)
    if scenario == "dynamics":
        runs = ("unguarded", "known_fix", "guarded", "reference", "adaptive_clip")
        return DemoSettings(scenario, n, lr=DYNAMICS_LR, reference_lr=STABLE_LR, runs=runs, warmup=warmup,
                            guard=_guard_settings(n),
                            adaptive=dict(remedies=[dict(type="adaptive_clip")], spike_window=50, spike_z=3.0,
                                          spike_warmup=10))
    return DemoSettings(scenario, n, lr=PETR_LR, reference_lr=PETR_LR, runs=("unguarded", "known_fix", "guarded"),
                        burst_at=int(n * 0.6) + 1, burst_frames=4, warmup=warmup, guard=_guard_settings(n))


def corrupt_raw16(x: torch.Tensor) -> torch.Tensor:
    """A normalized frame as it looks when normalization is skipped: raw 16-bit values, 65535 where saturated.

    The tokens stand for normalized pixels (mean 0, std 1); raw = 65535 * (0.5 + 0.25 * x), clamped to the
    sensor's range, so about 2% of the values sit at 65535 (> 65504, the largest fp16 number).
    """
    return (65535.0 * (0.5 + 0.25 * x)).clamp(0.0, 65535.0)


@dataclass
class RunResult:
    """What one run did, as measured.

    ``finished``: every iteration ran (the guard did not give up). ``state_finite``: weights and buffers finite
    at the end. ``eval_loss``: held-out loss in eval mode read before PETR's ``nan_to_num`` (None when not
    finite). ``lost``: state not finite, no finite held-out loss, or training stalled (the last tenth of the
    steps all skipped by the loss scaler). Guarded runs: ``causes`` (each divergence's class), ``held`` (the
    dynamics ladder's rungs that held) and ``lr_factor`` (the product of the guard's learning-rate backoffs).
    """

    key: str
    label: str
    finished: bool = True
    state_finite: bool = True
    eval_loss: Optional[float] = None
    incidents: int = 0
    iters_lost: int = 0
    wall_s: float = 0.0
    iters_done: int = 0
    steps: int = 0
    skipped_steps: int = 0
    loss_scale: float = math.nan
    lost: bool = False
    outcome: str = "completed"
    curve: List[List[float]] = field(default_factory=list)
    incident_iters: List[int] = field(default_factory=list)
    #: Per incident (divergence or stall), in order: the iterations its rollback undid (0 without a rollback).
    iters_lost_per_incident: List[int] = field(default_factory=list)
    causes: List[str] = field(default_factory=list)
    held: List[str] = field(default_factory=list)
    lr_factor: float = 1.0


def _import_mmengine() -> Any:
    try:
        from mmengine.hooks import Hook
        from mmengine.runner import Runner
    except ImportError as exc:  # pragma: no cover - the env always has it
        raise RuntimeError("the demo needs MMEngine (pip install mmengine mmcv-lite)") from exc
    import petr_stability  # noqa: F401  (registers NanGuardHook)
    from petr_stability.demo.amp import register

    register()  # CPUAmpOptimWrapper, PETRLikeModel

    return Hook, Runner


def _layer_cfg(dropout: float) -> dict:
    from petr_stability.demo.model import SEED_LAYER_CFG

    cfg = copy.deepcopy(SEED_LAYER_CFG)
    for attn in cfg["attn_cfgs"]:
        attn["dropout"] = dropout
    cfg["ffn_dropout"] = dropout
    return cfg


def _make_data(s: DemoSettings) -> Tuple[list, list]:
    from petr_stability.demo.model import make_batch

    # Enough frames for a guarded run that replays lost iterations on fresh data.
    n_train = 2 * s.iters * s.batch_size
    samples = make_batch(n_train + 16, tokens=s.tokens, num_query=s.num_query, seed=s.seed + 1)
    train, heldout = samples[:n_train], samples[n_train:]
    if s.burst_at:
        first = (s.burst_at - 1) * s.batch_size
        for i in range(first, first + s.burst_frames):
            train[i] = dict(train[i], inputs=corrupt_raw16(train[i]["inputs"]))
    return train, heldout


def _lr(key: str, s: DemoSettings) -> float:
    """A run's peak learning rate: the reference's (and its reshuffled twin's), or the scenario's."""
    return s.reference_lr if key in ("reference", "reshuffled") else s.lr


def _build_runner(key: str, work_dir: str, s: DemoSettings, train: list, hooks: List[Any]) -> Any:
    _, Runner = _import_mmengine()
    from petr_stability.demo.data import ListDataset

    fixed = key == "known_fix"
    lr = _lr(key, s)
    if key == "remedied":
        from petr_stability.core.config import GuardConfig

        lr *= GuardConfig().overflow_lr_backoff
    if key == "reshuffled":
        train = train[s.iters * s.batch_size // 3:]  # the stream holds twice the frames a run reads
    optimizer = dict(type="AdamW", lr=lr, weight_decay=0.01)
    if torch.cuda.is_available():
        wrapper = dict(type="AmpOptimWrapper", loss_scale="dynamic", dtype="float16")
    else:
        wrapper = dict(type="CPUAmpOptimWrapper", loss_scale="dynamic")
    wrapper.update(optimizer=optimizer, clip_grad=dict(max_norm=1 if fixed else 35, norm_type=2))
    hooks = list(hooks)
    if key == "guarded":
        hooks.insert(0, dict(type="NanGuardHook", **s.guard))
    if key == "adaptive_clip":  # the guard's own adaptive clip (GuardConfig.adaptive_clip), the guard on as well
        hooks.insert(0, dict(type="NanGuardHook", **dict(s.guard, **s.adaptive)))
    warmup = max(1, s.warmup)
    runner = Runner(
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
            dict(type="CosineAnnealingLR", by_epoch=False, begin=warmup, end=s.iters, eta_min=lr * 1e-3),
        ],
        train_cfg=dict(by_epoch=False, max_iters=s.iters),
        default_hooks=dict(
            checkpoint=dict(type="CheckpointHook", interval=s.iters, by_epoch=False, max_keep_ckpts=1),
            logger=dict(type="LoggerHook", interval=10),
        ),
        log_processor=dict(by_epoch=False),
        custom_hooks=hooks,
        default_scope="mmengine",
        randomness=dict(seed=s.seed),
        log_level="ERROR",
    )
    if key == "remedied":  # what the guard puts in fp32 where this scenario's decoder layer overflows
        from petr_stability.core.remedies.fp32 import force_fp32

        for i, layer in enumerate(runner.model.net.pts_bbox_head.layers):
            force_fp32(layer, f"net.pts_bbox_head.layers.{i}")
    return runner


def _progress_hooks(result: RunResult, work_dir: str, total: int, echo: bool) -> List[Any]:
    """A meter that reads each step before NanGuardHook acts on it, and a printer that runs after it."""
    Hook, _ = _import_mmengine()
    from petr_stability.core.records import read_incidents

    every = max(1, total // 5)
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
            result.curve.append([runner.iter + 1, loss, scale, 1.0 if finite else 0.0, float(grad)])

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
                    where = (f"rolled back to iter {int(back['iteration'])}, "
                             f"{rec.get('iterations_lost', 0)} iteration(s) lost" if back else rec.get("event", ""))
                    cause = (rec.get("cause") or {}).get("cause", "?")
                    acts = rec.get("actions", [])
                    shown = ", ".join(f"{a['target']} {_short(a['old'])} -> {_short(a['new'])}" for a in acts[:2])
                    print(f"    ! guard: incident at iter {rec.get('iteration')}: {rec.get('reason')}; cause {cause}; "
                          f"{where}; {len(acts)} setting(s) changed" + (f" ({shown}{', ...' if len(acts) > 2 else ''})"
                                                                        if acts else ""), flush=True)
            self.seen = len(records)
            now = runner.iter + 1
            if echo and (now % every == 0 or now == total) and result.curve:
                _, loss, scale, finite, _ = result.curve[-1]
                print(f"    iter {now:>4}/{total}  loss {loss:7.3f}  loss scale {scale:>9.3g}  "
                      f"skipped steps {result.skipped_steps:>3}  state {'finite' if finite else 'NON-FINITE'}  "
                      f"incidents {self.seen}  {time.perf_counter() - t0:5.1f}s", flush=True)

    return [_Meter(), _Printer()]


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _eval_loss(model: torch.nn.Module, heldout: list) -> Optional[float]:
    """Held-out loss in eval mode under the training's fp16 autocast, read before PETR's ``nan_to_num``.

    In eval mode BatchNorm normalizes with its running statistics, as at test time. The head turns NaN
    predictions into zeros (``nan_to_num``), so the last decoder layer's own output is taken and the class and
    box branches and losses are applied to it directly. None when the loss is not finite.
    """
    import torch.nn.functional as F

    from petr_stability.core.flags import autocast

    net = model.net if hasattr(model, "net") else model
    head = net.pts_bbox_head
    seen: List[torch.Tensor] = []
    handle = head.layers[-1].register_forward_hook(lambda m, i, out: seen.append(out))
    device = next(model.parameters()).device
    inputs = torch.stack([x["inputs"] for x in heldout]).to(device)
    cls_t = torch.stack([x["cls_t"] for x in heldout]).to(device)
    reg_t = torch.stack([x["reg_t"] for x in heldout]).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(device.type, torch.float16):
            head(net.img_backbone(inputs))
            out = seen[-1]
            cls = head.cls_branch(out).transpose(0, 1).float()
            reg = head.reg_branch(out).transpose(0, 1).float()
        loss = F.cross_entropy(cls.flatten(0, 1), cls_t.flatten()) + F.l1_loss(reg, reg_t)
    finally:
        handle.remove()
        model.train(was_training)
    value = float(loss)
    return value if math.isfinite(value) else None


def _run_dir(root: str, s: DemoSettings, key: str) -> str:
    return os.path.join(root, s.scenario, key)


def _run_one(key: str, root: str, s: DemoSettings, train: list, heldout: list, echo: bool) -> RunResult:
    from petr_stability.core.errors import NanGuardError
    from petr_stability.core.records import INCIDENT_EVENTS, Event, read_incidents

    work_dir = _run_dir(root, s, key)
    if os.path.isdir(work_dir):
        shutil.rmtree(work_dir)  # the demo's own output of an earlier run: the report must see this run only
    result = RunResult(key, RUNS[key][0])
    t0 = time.perf_counter()
    hooks = _progress_hooks(result, work_dir, s.iters, echo)
    runner = _build_runner(key, work_dir, s, train, hooks)
    try:
        runner.train()
    except NanGuardError as exc:
        result.finished = False
        result.outcome = f"guard gave up: {type(exc).__name__}"
    result.wall_s = round(time.perf_counter() - t0, 2)
    model = runner.model.module if hasattr(runner.model, "module") else runner.model
    records = read_incidents(work_dir)
    result.iters_done = int(runner.iter)
    result.finished = result.finished and result.iters_done >= s.iters
    result.incidents = sum(1 for r in records if r.get("event") in INCIDENT_EVENTS)
    result.iters_lost = sum(int(r.get("iterations_lost") or 0) for r in records)
    result.iters_lost_per_incident = [int(r.get("iterations_lost") or 0) for r in records
                                      if r.get("event") in INCIDENT_EVENTS]
    result.state_finite = _finite(list(model.parameters())) and _finite(list(model.buffers()))
    result.eval_loss = _eval_loss(model, heldout)
    scaler = getattr(runner.optim_wrapper, "loss_scaler", None)
    result.loss_scale = float(scaler.get_scale()) if scaler is not None else math.nan
    tail = result.curve[-max(1, s.iters // 10):]
    stalled = bool(tail) and all(not math.isfinite(p[4]) for p in tail)
    result.lost = not result.state_finite or result.eval_loss is None or stalled or not result.finished
    guard = next((h.guard for h in runner.hooks if type(h).__name__ == "NanGuardHook"), None)
    if guard is not None:
        result.causes = [str((r.get("cause") or {}).get("cause")) for r in records
                         if r.get("event") == Event.DIVERGENCE]
        summary = guard.summary()
        result.held = [str(rung) for rung in summary["held"]]
        result.lr_factor = float(summary["lr_factor"])
        if echo and result.held:
            print(f"    guard: the ladder's rung that held: {'; '.join(result.held)}", flush=True)
    if stalled and result.outcome == "completed":
        result.outcome = "stalled: every late step skipped"
    return result


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def format_table(results: Sequence[RunResult], iters: int) -> str:
    """The comparison table of one scenario, one row per run."""
    head = (f"{'run':<25} {'finished':>8} {'state finite':>12} {'eval loss':>9} {'incidents':>9} "
            f"{'iters lost':>10} {'skipped':>7} {'scale':>8} {'time':>7}  verdict")
    lines = [head, "-" * len(head)]
    for r in results:
        ev = "NaN/Inf" if r.eval_loss is None else f"{r.eval_loss:.3f}"
        verdict = "LOST" if r.lost else "ok"
        lines.append(
            f"{r.label:<25} {_yes(r.finished):>8} {_yes(r.state_finite):>12} {ev:>9} {r.incidents:>9} "
            f"{r.iters_lost:>10} {r.skipped_steps:>7} {r.loss_scale:>8.3g} {r.wall_s:>6.1f}s  {verdict}"
            + ("" if r.outcome == "completed" else f" ({r.outcome})")
        )
    return "\n".join(lines)


def summary_dict(results: Dict[str, List[RunResult]]) -> Dict[str, Any]:
    """``{"scenarios": {NAME: {"runs": {KEY: {finished, state_finite, eval_loss, incidents, iters_lost,
    iters_lost_per_incident, lost, wall_s}}}}}`` (the shape other tools read; ``lost`` is the table's verdict)."""
    return {"scenarios": {name: {"runs": {r.key: {
        "finished": bool(r.finished),
        "state_finite": bool(r.state_finite),
        "eval_loss": None if r.eval_loss is None else float(r.eval_loss),
        "incidents": int(r.incidents),
        "iters_lost": int(r.iters_lost),
        "iters_lost_per_incident": [int(n) for n in r.iters_lost_per_incident],
        "lost": bool(r.lost),
        "wall_s": round(float(r.wall_s), 2),
    } for r in runs}} for name, runs in results.items()}}


_COLORS = {"unguarded": "tab:red", "known_fix": "tab:orange", "guarded": "tab:blue", "reference": "tab:green",
           "adaptive_clip": "tab:purple", "reshuffled": "tab:olive"}


def _segments(curve: List[List[float]]) -> List[List[List[float]]]:
    """Splits a curve where a rollback set the iteration counter back: one segment per attempt."""
    segments: List[List[List[float]]] = [[]]
    for point in curve:
        if segments[-1] and point[0] <= segments[-1][-1][0]:
            segments.append([])
        segments[-1].append(point)
    return [s for s in segments if s]


def _plot(results: Dict[str, List[RunResult]], settings: Dict[str, DemoSettings], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(len(names), 2, figsize=(13, 4.2 * len(names)), squeeze=False,
                             gridspec_kw=dict(width_ratios=[3, 2]))
    window = 5
    for row, name in enumerate(names):
        s = settings[name]
        ax, ax2 = axes[row]
        if s.burst_at:
            burst_end = s.burst_at + (max(1, s.burst_frames) - 1) // s.batch_size
            for a in (ax, ax2):
                a.axvspan(s.burst_at - 0.5, burst_end + 0.5, color="grey", alpha=0.25, lw=0)
        # The guarded runs last and on top, so their first attempts never hide under another run's line.
        order = sorted(results[name], key=lambda r: r.key in ("guarded", "adaptive_clip"))
        for r in order:
            segs = _segments(r.curve)
            on_top = 3 if r.key == "guarded" else 2
            for i, seg in enumerate(segs):
                final = i == len(segs) - 1
                xs = [p[0] for p in seg]
                ys = []
                for j in range(len(seg)):
                    vals = [p[1] for p in seg[max(0, j - window + 1): j + 1] if math.isfinite(p[1])]
                    ys.append(sum(vals) / len(vals) if vals else math.nan)
                label = r.label if len(segs) == 1 else (
                    f"{r.label}: attempt {i + 1}" + ("" if final else " (rolled back)"))
                style = dict(color=_COLORS[r.key], lw=2.0 if final else 1.6, ls="-" if final else "--",
                             zorder=on_top + (0 if final else 1), alpha=0.95)
                if not final:
                    style.update(marker="o", ms=3, markevery=max(1, len(seg) // 8))
                ax.plot(xs, ys, label=label, **style)
                ax2.plot(xs, [max(p[2], 1e-30) for p in seg], **style)
                skipped = [p for p in seg if not math.isfinite(p[4])]
                if skipped and r.key not in ("reference", "reshuffled"):
                    ax.plot([p[0] for p in skipped], [0.02 * (1 + list(_COLORS).index(r.key))] * len(skipped),
                            "|", color=_COLORS[r.key], ms=6, transform=ax.get_xaxis_transform(), zorder=on_top)
            for it in r.incident_iters:
                ax.axvline(it, color=_COLORS[r.key], ls=":", lw=1.5)
        title = {"dynamics": f"dynamics: lr {s.lr:g} (reference {s.reference_lr:g}), nothing planted",
                 "data_burst": "data_burst: corrupted frames (grey band)"}[name]
        ax.set_title(title + "\nticks at the bottom: skipped steps; dotted: guard incidents; "
                     "dashed with dots: an attempt the guard rolled back", fontsize=9)
        ax.set_ylabel(f"training loss (mean of {window}, after nan_to_num)")
        ax.legend(loc="upper right", fontsize=7)
        ax2.set_yscale("log", base=2)
        ax2.set_ylabel("loss scale")
        for a in (ax, ax2):
            a.set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_demo(work_dir: str = "work_dirs/demo", iters: Optional[int] = None, quick: bool = False,
             echo: bool = True, scenarios: Optional[Sequence[str]] = None) -> Dict[str, List[RunResult]]:
    """Runs each scenario's runs one after the other, prints the tables, writes ``demo.png`` and ``summary.json``.

    Args:
        work_dir: parent of the runs' work dirs (``<work_dir>/<scenario>/<run>``). Defaults to ``work_dirs/demo``.
        iters: training iterations per run (>= 24). Defaults to None (each scenario's own).
        quick: the test's size (24 iterations per run). Defaults to False.
        echo: print progress and the tables. Defaults to True.
        scenarios: which of :data:`SCENARIOS` to run. Defaults to None (all).

    Returns:
        Scenario name -> one :class:`RunResult` per run.
    """
    names = list(SCENARIOS if scenarios is None else scenarios)
    settings = {name: settings_for(name, iters, quick) for name in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch/MMCV deprecation chatter would bury the progress lines
        return _run_demo(work_dir, settings, echo)


def _describe(s: DemoSettings, device: str) -> str:
    common = (f"{s.iters} iterations per run on {device}, fp16 autocast + dynamic loss scale, batch {s.batch_size}, "
              f"{s.num_layers} PETR decoder layer(s), AdamW wd 0.01, warm-up {s.warmup} then cosine.")
    guard = ("Guard: NanGuardHook(" + ", ".join(f"{k}={v}" for k, v in s.guard.items())
             + "), every other argument at its default.")
    if s.scenario == "dynamics":
        return (f"== dynamics: nothing planted. Peak lr {s.lr:g} (PETR's recipe: 2e-4 at batch 8), too high for "
                f"this model under fp16;\n   the reference run uses {s.reference_lr:g}. Attention logits grow until "
                f"fp16 overflows in the forward pass.\n   {common}\n   {guard}")
    first = (s.burst_at - 1) * s.batch_size
    return (f"== data_burst: lr {s.lr:g}. Trigger: frames {first}..{first + s.burst_frames - 1} (iteration "
            f"{s.burst_at} on) arrive as raw 16-bit values\n   (normalization skipped); saturated pixels (65535) "
            f"exceed fp16's max 65504.\n   {common}\n   {guard}")


def _run_demo(work_dir: str, settings: Dict[str, DemoSettings], echo: bool) -> Dict[str, List[RunResult]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(work_dir, exist_ok=True)
    results: Dict[str, List[RunResult]] = {}
    for name, s in settings.items():
        if echo:
            print(_describe(s, device), flush=True)
        train, heldout = _make_data(s)
        results[name] = []
        for key in s.runs:
            if echo:
                label, what = RUNS[key]
                lr = _lr(key, s)
                print(f"\n  {label}: {what}, lr {lr:g}", flush=True)
            results[name].append(_run_one(key, work_dir, s, train, heldout, echo))
        if echo:
            print(f"\n{format_table(results[name], s.iters)}\n", flush=True)
    plot_path = os.path.join(work_dir, "demo.png")
    _plot(results, settings, plot_path)
    with open(os.path.join(work_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary_dict(results), f, indent=1)
    with open(os.path.join(work_dir, "details.json"), "w", encoding="utf-8") as f:
        json.dump({name: dict(settings=asdict(settings[name]), device=device,
                              runs=[{k: v for k, v in asdict(r).items() if k != "curve"} for r in runs])
                   for name, runs in results.items()}, f, indent=1, default=str)
    if echo:
        print("eval loss: held-out loss on 16 clean frames in eval mode (BatchNorm on its running statistics), fp16 "
              "autocast,\nread before PETR's nan_to_num. skipped: steps the loss scaler skipped (7-8 of them are the "
              "scale calibrating down from 2^16).\nLOST: state not finite, no finite held-out loss, training stalled "
              "(every step of the last tenth skipped) or the guard gave up.")
        print(f"plot: {plot_path}\nsummary: {os.path.join(work_dir, 'summary.json')}\n"
              f"next: petr-stability report {_run_dir(work_dir, next(iter(settings.values())), 'guarded')}")
    return results
