"""The fp32 remedy: a module's forward run with autocast off and half inputs cast up, from now on."""
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..causes import Cause
from ..flags import autocast_off
from ..validate import Setting, is_names
from .base import Change, ConfigEntry, Context, Incident, Outcome, Remedy, Run, When

__all__ = ["force_fp32", "release_fp32", "is_fp32", "fp32_modules", "apply_fp32", "Fp32Remedy"]

_HALF = (torch.float16, torch.bfloat16)
_MARK = "_petr_stability_fp32"


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in _HALF else obj
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _to_fp32(v)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_to_fp32(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


class _Fp32Forward:
    """Stands in for a module's ``forward``: autocast off inside, half-precision floating inputs cast to float32.

    Kept as an instance attribute of the module (what ``nn.Module.__call__`` calls), so hooks, ``state_dict`` and
    the module's identity are untouched; a plain object (not a closure) so copies and pickles of the model keep it.
    """

    def __init__(self, module: nn.Module, prior: Any, fp16_flags: List[Tuple[nn.Module, Any]]) -> None:
        self.module = module
        self.prior = prior  # an instance forward that was already there, or None for the class's own
        self.fp16_flags = fp16_flags  # (module, old fp16_enabled) switched off for MMCV's @auto_fp16

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with autocast_off():
            args, kwargs = _to_fp32(args), _to_fp32(kwargs)
            if self.prior is not None:
                return self.prior(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)


def is_fp32(module: nn.Module) -> bool:
    """Whether :func:`force_fp32` is in effect on ``module``."""
    return isinstance(module.__dict__.get("forward"), _Fp32Forward)


def force_fp32(module: nn.Module, name: str = "") -> Optional[Change]:
    """Runs ``module`` in fp32 from now on: autocast (CPU and CUDA) off inside its forward, half-precision
    floating inputs cast up to float32; its output stays float32 (downstream autocast ops cast as they need).

    Idempotent. MMCV 1.x's ``@auto_fp16`` re-enters autocast where ``fp16_enabled`` is set: that flag is switched
    off on the module and its descendants too (and put back by :func:`release_fp32`). Copies and pickles of the
    model keep the setting; after a resume into a fresh model, re-apply it with :func:`apply_fp32` from the names
    :func:`fp32_modules` gave.

    Args:
        module: the module (a submodule of the unwrapped model).
        name: its name, for the change record. Defaults to "" (the class name).

    Returns:
        ``Change(name, 'autocast', 'float32')``, or None when it already ran in fp32.
    """
    if is_fp32(module):
        return None
    prior = module.__dict__.get("forward")
    flags = []
    for sub in module.modules():
        if getattr(sub, "fp16_enabled", False) is True:
            flags.append((sub, True))
            sub.fp16_enabled = False
    module.forward = _Fp32Forward(module, prior, flags)
    return Change(name or type(module).__name__, "autocast", "float32")


def release_fp32(module: nn.Module, name: str = "") -> Optional[Change]:
    """Undoes :func:`force_fp32`. Returns the change, or None when the module was not forced."""
    wrapper = module.__dict__.get("forward")
    if not isinstance(wrapper, _Fp32Forward):
        return None
    if wrapper.prior is not None:
        module.forward = wrapper.prior
    else:
        del module.forward
    for sub, value in wrapper.fp16_flags:
        sub.fp16_enabled = value
    return Change(name or type(module).__name__, "float32", "autocast")


def fp32_modules(model: nn.Module) -> List[str]:
    """Names of the modules :func:`force_fp32` put in fp32, for the guard's checkpoint state."""
    return [name or "(model)" for name, m in model.named_modules() if is_fp32(m)]


def apply_fp32(model: nn.Module, names: Iterable[str]) -> List[Change]:
    """:func:`force_fp32` on each named module (after a resume); returns the changes made.

    Raises:
        ValueError: a name is not a module of ``model``.
    """
    changes = []
    for name in names:
        try:
            module = model if name == "(model)" else model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"no module named {name!r} in the model (cannot run it in fp32)") from None
        change = force_fp32(module, name)
        if change is not None:
            changes.append(change)
    return changes


class Fp32Remedy(Remedy):
    """Forward overflow: the module named runs in fp32 from now on (already in fp32: structural); with
    ``fp32_modules``, from the start; again on resume."""

    name = "fp32"
    order = 80
    label = "module in fp32"
    causes = (Cause.FORWARD_OVERFLOW,)
    settings = (Setting("fp32_modules", (), is_names, "modules (names as ``model.named_modules()`` gives them) run "
                        "in fp32 from the start: what an earlier run's forward-overflow remedy learnt, as its patched "
                        "config carries it.", start=True),)
    state = ("fp32",)
    idle = {"fp32_modules": {}}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.fp32: List[str] = []

    def match(self, ctx: Context) -> bool:
        return ctx.event != When.START or bool(self.fp32 or self.config.fp32_modules)

    def before_restore(self, run: Run, incident: Incident) -> Outcome:
        modules = list(incident.cls.modules)
        if all(m in self.fp32 for m in modules):
            return Outcome(evidence="; the module already runs in fp32", cause=Cause.STRUCTURAL)
        changes = apply_fp32(run.io.model(), modules)
        self.fp32.extend(m for m in modules if m not in self.fp32)
        return Outcome(tuple(changes))

    def on_start(self, run: Run) -> List[Change]:
        io = run.io
        changes = apply_fp32(io.model(), self.fp32)
        for change in changes:
            io.log(f"NanGuard: resumed remedy: {change.target} runs in fp32")
        configured = [m for m in self.config.fp32_modules if m not in self.fp32]
        for change in apply_fp32(io.model(), configured):
            io.log(f"NanGuard: {change.target} runs in fp32 (fp32_modules)")
            changes.append(change)
        self.fp32.extend(configured)
        return changes

    def load_value(self, key: str, value: Any) -> Any:
        return [str(m) for m in value or []]

    def summary(self, io: Any) -> Dict[str, Any]:
        model = io.model()
        return {"fp32_modules": {m: type(model if m == "(model)" else model.get_submodule(m)).__name__
                                 for m in self.fp32}}

    def config_entry(self, io: Any) -> ConfigEntry:
        return ConfigEntry(fix=self.summary(io))
