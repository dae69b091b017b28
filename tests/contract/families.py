"""The runner families the contract suite runs over: each builds a small fp16 PETR-shaped run the same way.

A family is whatever this environment can run: the plain torch loop always, MMEngine where it is installed,
MMCV 1.x where it is. Every test in test_contract.py runs over each of them.
"""
import glob
import json
import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional

import torch
from logs import read_board, strict_json_lines
from torch import nn
from torch.utils.data import DataLoader

from petr_stability.adapters.driver import GuardDriver
from petr_stability.adapters.torch_loop import TorchLoopIO
from petr_stability.core.config import GuardConfig
from petr_stability.core.faults import FaultPlan
from petr_stability.core.flags import make_grad_scaler
from petr_stability.testing.data import ListDataset
from petr_stability.testing.data_faults import GradReads
from petr_stability.testing.stacks import has_mmcv1, has_mmengine


def poison_pixels(sample: Dict[str, Any], value: float = math.nan) -> Dict[str, Any]:
    # Imported when a runner family builds a PETR-shaped dataset (it needs MMCV's bricks, as the family does).
    from petr_stability.testing.causes_models import poison_pixels as poison

    return poison(sample, value=value)

HERE = os.path.dirname(os.path.abspath(__file__))


class RunLogs:
    """What a run showed its user: its JSON-lines files (each line parsed strictly), its TensorBoard events and the
    guard's log lines."""

    def __init__(self, json_files: List[str], board_dir: str, lines: List[str]) -> None:
        self.json = {path: strict_json_lines(path) for path in json_files}
        self.board, self.order = read_board(board_dir)
        self.lines = lines


def collect(lines: List[str]) -> Any:
    """A logging handler that keeps each message in ``lines``."""
    import logging

    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    return handler


class TinyDetector(nn.Module):
    """A transformer decoder layer (dropout 0.1) over a projection: the torch loop's stand-in for PETR."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 32)
        self.layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.1)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.out(self.layer(h, h)).pow(2).mean()


class TorchLoopRun:
    """A hand-written fp16 loop (CPU autocast + GradScaler) behind TorchLoopIO and the driver; with ``accumulate > 1``
    it steps every ``accumulate`` iterations and zeroes the gradients after the step, as MMEngine and MMCV 1.x do."""

    IO = TorchLoopIO

    def __init__(self, work_dir: str, iters: int, guard: Dict[str, Any], faults: List[dict], clip: str,
                 state: Optional[Dict[str, Any]] = None, accumulate: int = 1, logs: bool = False) -> None:
        self.iters = iters
        self.accumulate = accumulate
        self.grad_reads = GradReads()
        self.work_dir = work_dir
        self.model = TinyDetector()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        clip_kwargs = {"norm": {"max_norm": 35.0, "norm_type": 2}, "none": None}[clip]
        self.lines: List[str] = []
        self.writer = None
        if logs:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(work_dir, "tf_logs"))
        self.io = TorchLoopIO(self.model, self.opt, make_grad_scaler("cpu", init_scale=64.0), clip_kwargs,
                              work_dir, log_fn=self.lines.append, writer=self.writer,
                              config={"model": {"type": "TinyDetector"}, "optim_wrapper": {"clip_grad": clip_kwargs},
                                      "custom_hooks": [{"type": "NanGuardHook"}]})
        self.calls: Dict[int, List[Callable[[], Any]]] = {}
        self.driver = GuardDriver(GuardConfig(**guard))
        self.driver.bind(self.io)
        self.driver.load_state(state)
        self.plan = FaultPlan(faults)
        torch.manual_seed(1)
        # A map-style dataset of (2, 16) samples, 8 per batch (the decoder's sequence axis), 4 batches per pass.
        self.samples = list(torch.randn(32, 2, 16))
        self.io.loader = DataLoader(ListDataset(self.samples), batch_size=8, shuffle=False)
        self.batch_size = 8

    def train(self) -> None:
        self.driver.start()
        batches = iter(self.io.loader)
        while self.io.iter < self.iters:
            batch = next(batches, None)
            if batch is None:  # the next pass over the data
                batches = iter(self.io.loader)
                batch = next(batches)
            for call in self.calls.get(self.io.iter + 1, []):
                call()
            self.plan.inject(self.io.iter, 0, self.model, batch)
            self.grad_reads.read(self.io.iter + 1, self.model)
            self.driver.before_iter(batch)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = self.model(batch)
            scaler = self.io.grad_scaler
            scaler.scale(loss / self.accumulate).backward()
            if (self.io.iter + 1) % self.accumulate == 0:
                scaler.unscale_(self.opt)
                self.io.clip(self.model.parameters())
                scaler.step(self.opt)
                scaler.update()
                self.opt.zero_grad()
            self.plan.disarm()
            self.io.last_loss = float(loss)
            self.driver.after_iter()
            self.io.iter += 1
        self.driver.finish()
        if self.writer is not None:
            self.writer.close()

    def at_iteration(self, iteration: int, call: Callable[[], Any]) -> None:
        """Runs ``call`` as iteration ``iteration`` (1-based) starts, each time it does."""
        self.calls.setdefault(iteration, []).append(call)

    def read_logs(self) -> RunLogs:
        return RunLogs([], os.path.join(self.work_dir, "tf_logs"), self.lines)

    # what the contract reads
    @property
    def guard(self) -> Any:
        return self.driver.guard

    def clip_kwargs(self) -> Dict[str, Any]:
        return self.io.clip_kwargs

    def completed(self) -> int:
        return self.io.iter

    def params_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def dropouts(self) -> List[float]:
        return [m.p for m in self.model.modules() if isinstance(m, nn.Dropout)]

    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def saved_state(self) -> Dict[str, Any]:
        return json.loads(json.dumps(self.driver.state_dict()))

    def corrupt(self, index: int, value: float = math.nan) -> None:
        """NaN (or ``value``) features in one sample of the dataset (a corrupt record)."""
        self.samples[index][0] = value

    def live_dataset(self) -> Any:
        """The dataset the training loader reads (after train())."""
        return self.io.loader.dataset

    def wrap_dataset(self, wrap: Any) -> Any:
        """Trains on ``wrap(the dataset)`` (before train()); returns the wrapped dataset."""
        dataset = wrap(self.io.loader.dataset)
        self.io.loader = DataLoader(dataset, batch_size=self.batch_size, shuffle=False)
        return dataset

    def set_batch_size(self, n: int) -> None:
        """Trains with batches of ``n`` (before train())."""
        self.batch_size = n
        self.io.loader = DataLoader(self.io.loader.dataset, batch_size=n, shuffle=False)


class MMEngineRun:
    """A real MMEngine Runner (tests/mmengine/harness.py) with the CPU fp16 AmpOptimWrapper."""

    @property
    def IO(self) -> Any:  # noqa: N802 (the class, as the other families name it)
        from petr_stability.adapters.mmengine_runner.io import MMEngineIO

        return MMEngineIO

    def __init__(self, work_dir: str, iters: int, guard: Dict[str, Any], faults: List[dict], clip: str,
                 checkpoint: Optional[dict] = None, resume: bool = False, cfg: Optional[dict] = None,
                 accumulate: int = 1, logs: bool = False) -> None:
        sys.path.insert(0, os.path.join(HERE, "..", "mmengine"))
        from harness import build_runner
        from mmengine.hooks import Hook

        clip_grad = {"norm": dict(max_norm=35, norm_type=2), "value": dict(type="value", clip_value=1.0),
                     "none": None}[clip]
        visualizer = dict(type="Visualizer", vis_backends=[dict(type="LocalVisBackend"),
                                                           dict(type="TensorboardVisBackend")]) if logs else None
        self.runner = build_runner(work_dir, amp=dict(init_scale=64.0), max_iters=iters, guard=guard, faults=faults,
                                   model_kwargs=dict(num_layers=1, num_query=16), clip_grad=clip_grad,
                                   checkpoint=checkpoint, resume=resume, cfg=cfg, lr=LR,
                                   accumulative_counts=accumulate, visualizer=visualizer)
        self.hook = next(h for h in self.runner.hooks if type(h).__name__ == "NanGuardHook")
        self.batch_size = self.runner._train_dataloader["batch_size"]
        self.grad_reads = GradReads()
        self.runner.register_hook(read_grads_hook(Hook, self.grad_reads), priority="HIGHEST")
        self.lines: List[str] = []
        if logs:
            from mmengine.logging import MMLogger

            MMLogger.get_current_instance().addHandler(collect(self.lines))

    def at_iteration(self, iteration: int, call: Callable[[], Any]) -> None:
        """Runs ``call`` as iteration ``iteration`` (1-based) starts, each time it does."""
        from mmengine.hooks import Hook

        class At(Hook):
            def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
                if runner.iter + 1 == iteration:
                    call()

        self.runner.register_hook(At(), priority="HIGHEST")

    def read_logs(self) -> RunLogs:
        vis = self.runner.visualizer.get_backend("LocalVisBackend")._save_dir
        return RunLogs(sorted(glob.glob(os.path.join(vis, "*.json"))), vis, self.lines)

    def train(self) -> None:
        self.runner.train()

    def corrupt(self, index: int, value: float = math.nan) -> None:
        """NaN (or ``value``) pixels in one sample of the dataset (a corrupt image)."""
        samples = self._leaf.samples  # the loader is built by train()
        samples[index] = poison_pixels(samples[index], value)

    @property
    def _leaf(self) -> Any:
        return getattr(self, "leaf", None) or self.runner._train_dataloader["dataset"]

    def live_dataset(self) -> Any:
        """The dataset the training loader reads (after train(): MMEngine builds the loader from a deep copy)."""
        return self.runner.train_dataloader.dataset

    def wrap_dataset(self, wrap: Any) -> Any:
        """Trains on ``wrap(the dataset)`` (before train()); returns the wrapped dataset."""
        self.leaf = self.runner._train_dataloader["dataset"]
        self.runner._train_dataloader["dataset"] = wrap(self.leaf)
        return self.runner._train_dataloader["dataset"]

    def set_batch_size(self, n: int) -> None:
        """Trains with batches of ``n`` (before train())."""
        self.batch_size = self.runner._train_dataloader["batch_size"] = n

    @property
    def guard(self) -> Any:
        return self.hook.guard

    def clip_kwargs(self) -> Dict[str, Any]:
        return self.runner.optim_wrapper.clip_grad_kwargs

    def completed(self) -> int:
        return self.runner.iter

    def params_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.runner.model.parameters())

    def dropouts(self) -> List[float]:
        head = self.runner.model.net.pts_bbox_head
        return [m.p for m in head.modules() if isinstance(m, nn.Dropout)]

    def lr(self) -> float:
        return self.runner.optim_wrapper.param_groups[0]["lr"]


class MMCV1Run:
    """A real MMCV 1.x IterBasedRunner (tests/mmcv1/harness.py) with the CPU Fp16OptimizerHook."""

    @property
    def IO(self) -> Any:  # noqa: N802 (the class, as the other families name it)
        from petr_stability.adapters.mmcv1_runner.io import MMCV1IO

        return MMCV1IO

    def __init__(self, work_dir: str, iters: int, guard: Dict[str, Any], faults: List[dict], clip: str,
                 checkpoint: Optional[dict] = None, meta: Optional[dict] = None, accumulate: int = 1,
                 logs: bool = False) -> None:
        sys.path.insert(0, os.path.join(HERE, "..", "mmcv1"))
        from harness import build_runner
        from mmcv.runner import Hook

        grad_clip = {"norm": dict(max_norm=35, norm_type=2), "none": None}[clip]
        loggers = [dict(type="TextLoggerHook")] + ([dict(type="TensorboardLoggerHook")] if logs else [])
        self.runner = build_runner(work_dir, runner="iter", amp=dict(init_scale=64.0), max_iters=iters, guard=guard,
                                   faults=faults, grad_clip=grad_clip, checkpoint=checkpoint, meta=meta, lr=LR,
                                   cumulative_iters=accumulate, log_hooks=loggers)
        self.hook = next(h for h in self.runner.hooks if type(h).__name__ == "NanGuardHook")
        self.batch_size = self.runner.loader.batch_size
        self.grad_reads = GradReads()
        self.runner.register_hook(read_grads_hook(Hook, self.grad_reads), priority="HIGHEST")
        self.work_dir = work_dir
        self.lines: List[str] = []
        if logs:
            self.runner.logger.addHandler(collect(self.lines))

    def at_iteration(self, iteration: int, call: Callable[[], Any]) -> None:
        """Runs ``call`` as iteration ``iteration`` (1-based) starts, each time it does."""
        from mmcv.runner import Hook

        class At(Hook):
            def before_train_iter(self, runner: Any) -> None:
                if runner.iter + 1 == iteration:
                    call()

        self.runner.register_hook(At(), priority="HIGHEST")

    def read_logs(self) -> RunLogs:
        return RunLogs(sorted(glob.glob(os.path.join(self.work_dir, "*.log.json"))),
                       os.path.join(self.work_dir, "tf_logs"), self.lines)

    def train(self) -> None:
        self.runner.run([self.runner.loader], [("train", 1)])

    def corrupt(self, index: int, value: float = math.nan) -> None:
        """NaN (or ``value``) pixels in one sample of the dataset (a corrupt image)."""
        samples = (getattr(self, "leaf", None) or self.runner.loader.dataset).samples
        samples[index] = poison_pixels(samples[index], value)

    def live_dataset(self) -> Any:
        """The dataset the training loader reads (after train())."""
        return self.runner.loader.dataset

    def wrap_dataset(self, wrap: Any) -> Any:
        """Trains on ``wrap(the dataset)`` (before train()); returns the wrapped dataset."""
        self.leaf = self.runner.loader.dataset
        loader = self.runner.loader
        self.runner.loader = DataLoader(wrap(self.leaf), batch_size=loader.batch_size, shuffle=False)
        return self.runner.loader.dataset

    def set_batch_size(self, n: int) -> None:
        """Trains with batches of ``n`` (before train())."""
        self.batch_size = n
        self.runner.loader = DataLoader(self.runner.loader.dataset, batch_size=n, shuffle=False)

    @property
    def guard(self) -> Any:
        return self.hook.guard

    def clip_kwargs(self) -> Dict[str, Any]:
        hook = next(h for h in self.runner.hooks if hasattr(h, "clip_grads"))
        return hook.grad_clip

    def completed(self) -> int:
        return self.runner.iter

    def params_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.runner.model.parameters())

    def dropouts(self) -> List[float]:
        return [m.p for m in self.runner.model.modules() if isinstance(m, nn.Dropout)
                and "backbone" not in type(m).__module__]

    def lr(self) -> float:
        return self.runner.optimizer.param_groups[0]["lr"]


#: The learning rate every family trains with (a data fault must leave it there).
LR = 2e-4


def read_grads_hook(base: Any, reads: GradReads) -> Any:
    """A runner hook (a subclass of the family's ``base`` Hook) reading the gradients before each iteration."""

    class ReadGrads(base):
        def before_train_iter(self, runner: Any, *args: Any, **kwargs: Any) -> None:
            reads.read(runner.iter + 1, runner.model)

    return ReadGrads()


#: (name, builder) of the families this environment runs.
FAMILIES = [("torch_loop", TorchLoopRun)]
if has_mmengine():
    FAMILIES.append(("mmengine", MMEngineRun))
if has_mmcv1():
    FAMILIES.append(("mmcv1", MMCV1Run))

#: Small and deterministic: snapshots every 5 iterations, confirmed after 3 clean steps.
GUARD = dict(snapshot_interval=5, confirm_steps=3, check_interval=5)


def finite(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)
