"""A plain-torch training loop behind GuardIO: the core guard tested without any runner."""
import copy
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from petr_stability.core.config import GuardConfig
from petr_stability.core.guard import NanGuard
from petr_stability.core.port import ClipSetting, GuardIO, Payload, StepReading
from petr_stability.core.watch.probe import ClipProbe


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.layer(x)).mean()


class FakeIO(GuardIO):
    """fp32 or scaled training of TinyTransformer; ``scale`` mimics a loss scaler's reading."""

    def __init__(self, work_dir: Optional[str] = None, mode: str = "none", skip: bool = True):
        self.work_dir = work_dir
        self.net = TinyTransformer()
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.01)
        self.clip = {"max_norm": 35.0, "norm_type": 2}
        self.probe = ClipProbe(torch.nn.utils.clip_grad_norm_, skip_nonfinite=skip and mode == "none")
        self.mode = mode
        self.scale = 65536.0
        self.iter = 0
        self.epoch = 0
        self.last_loss: Optional[float] = None
        self.logs: List[Tuple[str, str]] = []
        self.scalars: Dict[str, float] = {}
        self.texts: List[tuple] = []
        self.restores: List[int] = []
        self.ckpts: List[str] = []
        self.loaded: Dict[str, Any] = {}

    # training
    def train_step(self, poison_grad: bool = False, poison_loss: bool = False) -> None:
        x = torch.randn(4, 2, 8)
        loss = self.net(x)
        if poison_loss:
            loss = loss * math.nan
        self.opt.zero_grad()
        loss.backward()
        if poison_grad:
            self.net.out.weight.grad[0, 0] = math.inf
        norm = self.probe(self.net.parameters(), **self.clip)
        if self.mode != "none" and not math.isfinite(float(norm)):
            self.scale /= 2  # the scaler skips the step and backs off
        else:
            self.opt.step()
        self.last_loss = float(loss)

    # GuardIO
    def model(self):
        return self.net

    def optimizers(self):
        return [self.opt]

    def install_probes(self, skip_nonfinite_fp32):
        self.probe.skip_nonfinite = skip_nonfinite_fp32 and self.mode == "none"

    def read_step(self):
        stepped, norm, skipped = self.probe.read()
        return StepReading(stepped, norm, skipped, self.last_loss)

    def scale_mode(self):
        return self.mode

    def loss_scale(self):
        return None if self.mode == "none" else self.scale

    def clip_settings(self):
        return [ClipSetting("clip.max_norm", self.clip)]

    def capture(self):
        return {"state_dict": self.net.state_dict(), "optimizer": self.opt.state_dict()}

    def restore(self, payload):
        self.net.load_state_dict(payload.state["state_dict"])
        self.opt.load_state_dict(copy.deepcopy(payload.state["optimizer"]))
        self.restores.append(payload.iteration)

    def counter(self):
        return self.iter, self.epoch

    def set_counter(self, value):
        self.iter = value

    def log(self, msg, level="info"):
        self.logs.append((level, msg))

    def update_scalars(self, scalars, iterations_lost=0):
        self.scalars.update(scalars)
        self.iterations_lost = iterations_lost

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))

    def checkpoint_files(self):
        return list(self.ckpts)

    def read_checkpoint(self, path):
        """``loaded[path]`` is (state, completed iterations, guard state)."""
        if path not in self.loaded:
            raise OSError(f"truncated file {path}")
        state, iteration, guard_state = copy.deepcopy(self.loaded[path])
        return Payload(state, iteration, 0, source=path, strict=False), guard_state


def make_guard(io: FakeIO, **kwargs: Any) -> NanGuard:
    cfg = dict(snapshot_interval=5, confirm_steps=3, check_interval=4)
    cfg.update(kwargs)
    guard = NanGuard(GuardConfig(**cfg), io)
    io.install_probes(guard.config.skip_nonfinite_fp32)
    guard.setup()
    guard.capture_start()
    return guard


def run(io: FakeIO, guard: NanGuard, n: int, faults: Optional[Dict[int, str]] = None) -> List[Any]:
    """Runs until ``io.iter`` reaches ``n`` counted iterations; ``faults`` maps 0-based iter -> kind (fires once)."""
    faults = dict(faults or {})
    verdicts = []
    steps = 0
    while io.iter < n:
        steps += 1
        assert steps < 10 * n, "the loop does not terminate"
        kind = faults.pop(io.iter, None)
        if kind == "weights":
            with torch.no_grad():
                io.net.out.weight[0, 0] = math.nan
        io.train_step(poison_grad=kind == "grad", poison_loss=kind == "loss")
        verdicts.append((io.iter, guard.after_iter().verdict.name))
        io.iter += 1
    return verdicts
