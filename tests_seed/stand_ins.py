"""The CPU stand-ins the real StreamPETR / PETR code needs to train without a GPU, all scoped and undone.

Nothing here changes what the projects' code computes; it only replaces what a CPU machine lacks:

- ``flash_attn``: StreamPETR's ``models/utils/attention.py`` imports it at module level. A stub package is put in
  ``sys.modules`` whose functions raise if anything calls them: the test configs swap the config's
  ``PETRMultiheadFlashAttention`` for the plugin's own ``PETRMultiheadAttention(fp16=True)``, as StreamPETR's
  2080Ti config does, so the stub is never run.
- ``.cuda()``: the plugins call it on tensors they build (``prepare_for_dn``, ``GridMask``) and the training entry
  points on the model (StreamPETR's ``custom_train_detector``, mmdet3d 1.0.0rc6's ``train_detector``, which PETR's
  ``tools/train.py`` calls). It returns its argument unchanged, but only when called from a file of the clone or
  from ``mmdet3d/apis/train.py``; everywhere else it is torch's own (and fails without a GPU, as it should).
- MMCV's fp16: ``@auto_fp16`` / ``@force_fp32`` open ``torch.cuda.amp.autocast``, which does nothing on a CPU.
  ``mmcv.runner.fp16_utils.autocast`` becomes CPU fp16 autocast, so exactly the GPU's fp16 regions run in fp16:
  the ``@auto_fp16`` methods (backbone + neck, the transformer) in fp16, the ``@force_fp32`` islands (the
  detector's ``forward``, the heads' losses) in fp32, as on a GPU (``islands=True``). ``islands=False`` is the
  first emulation the issue tried: every forward of the detector under fp16 autocast and ``@force_fp32`` no
  longer switching it off, a forward that overflows on every batch in StreamPETR's position encoding.

- fp16 convolution backward: torch's CPU kernel for it is a slow fallback, so the fp16 convolution's backward is
  computed in fp32 and rounded to fp16, as a GPU's accumulates in fp32 and writes fp16
  (``petr_stability.testing.fp16_conv``, shared with the mmdet3d 1.4 suite).

- ``runner.resume(path)``: MMCV 1.x's default ``map_location='default'`` maps every storage to the current CUDA
  device (``torch.cuda.current_device()``); the projects' entry points call it so for ``resume_from``. Without a
  GPU it maps to ``'cpu'``, which is what ``'default'`` means on a CPU machine.

The GradScaler is the package's ``CPUFp16OptimizerHook`` (MMCV's ``Fp16OptimizerHook`` with a CPU GradScaler),
named in the config as ``optimizer_config.type``; it needs no patch.
"""
import contextlib
import functools
import os
import sys
import types
from typing import Any, Callable, Iterator, List, Tuple

import torch

from petr_stability.testing.fp16_conv import fp16_conv_backward_in_fp32

__all__ = ["cpu_stand_ins", "flash_attn_stub", "StandIns", "wrap_forward"]


def flash_attn_stub() -> List[Tuple[str, types.ModuleType]]:
    """The ``flash_attn`` modules StreamPETR's attention.py imports; every function raises when called."""

    def unavailable(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"flash_attn.{name} is a CPU test stub: the config must not use flash attention "
                               "(tests_seed swaps PETRMultiheadFlashAttention for PETRMultiheadAttention(fp16=True))")

        return call

    root = types.ModuleType("flash_attn")
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface.flash_attn_unpadded_kvpacked_func = unavailable("flash_attn_unpadded_kvpacked_func")
    padding = types.ModuleType("flash_attn.bert_padding")
    for name in ("unpad_input", "pad_input", "index_first_axis"):
        setattr(padding, name, unavailable(name))
    root.flash_attn_interface = iface
    root.bert_padding = padding
    return [("flash_attn", root), ("flash_attn.flash_attn_interface", iface), ("flash_attn.bert_padding", padding)]


def _cpu_autocast(islands: bool) -> Callable[..., Any]:
    """What ``mmcv.runner.fp16_utils.autocast`` becomes: MMCV calls ``autocast(enabled=True)`` in
    ``@auto_fp16`` and ``autocast(enabled=False)`` in ``@force_fp32``."""

    def autocast(enabled: bool = True, **kwargs: Any) -> Any:
        if not enabled and not islands:
            return contextlib.nullcontext()  # the island is not honoured: whatever autocast is on stays on
        return torch.autocast("cpu", dtype=torch.float16, enabled=enabled)

    return autocast


@contextlib.contextmanager
def cpu_stand_ins(clone_root: str, islands: bool = True) -> Iterator["StandIns"]:
    """Applies the stand-ins for the duration of the block and undoes every one of them on the way out.

    Args:
        clone_root: the project's clone; ``.cuda()`` is the identity only for calls from its files (and from
            mmdet3d's training entry point).
        islands: True: GPU semantics (``@force_fp32`` switches autocast off). False: ``@force_fp32`` leaves
            autocast on, and :meth:`StandIns.whole_forward` puts a detector's whole forward under fp16 autocast.

    Yields:
        A :class:`StandIns` (the detector classes exist only once the plugin is imported, inside the block).
    """
    import mmdet3d.apis.train as mmdet3d_train
    from mmcv.runner import fp16_utils

    root = os.path.realpath(clone_root) + os.sep
    entry = os.path.realpath(mmdet3d_train.__file__)
    undo: List[Callable[[], None]] = []

    # flash_attn: only where the environment has none (a GPU machine with the real one keeps it).
    for name, module in flash_attn_stub():
        if name not in sys.modules:
            sys.modules[name] = module
            undo.append(functools.partial(sys.modules.pop, name, None))

    def from_clone() -> bool:
        caller = os.path.realpath(sys._getframe(2).f_code.co_filename)  # the caller of .cuda()
        return caller.startswith(root) or caller == entry

    tensor_cuda, module_cuda = torch.Tensor.cuda, torch.nn.Module.cuda

    def tensor_identity(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if from_clone() else tensor_cuda(self, *args, **kwargs)

    def module_identity(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        return self if from_clone() else module_cuda(self, *args, **kwargs)

    torch.Tensor.cuda = tensor_identity
    torch.nn.Module.cuda = module_identity
    undo.append(lambda: setattr(torch.Tensor, "cuda", tensor_cuda))
    undo.append(lambda: setattr(torch.nn.Module, "cuda", module_cuda))

    conv = fp16_conv_backward_in_fp32()
    conv.__enter__()
    undo.append(lambda: conv.__exit__(None, None, None))

    from mmcv.runner import BaseRunner, IterBasedRunner

    for runner_cls in (BaseRunner, IterBasedRunner):
        undo.append(_cpu_resume(runner_cls))

    had_autocast = hasattr(fp16_utils, "autocast")
    mmcv_autocast = getattr(fp16_utils, "autocast", None)
    fp16_utils.autocast = _cpu_autocast(islands)
    undo.append(lambda: setattr(fp16_utils, "autocast", mmcv_autocast) if had_autocast
                else delattr(fp16_utils, "autocast"))
    try:
        yield StandIns(islands, undo)
    finally:
        for step in reversed(undo):
            step()


def _cpu_resume(cls: type) -> Callable[[], None]:
    """``cls.resume`` with ``map_location='default'`` meaning ``'cpu'``; returns the undo."""
    original = cls.__dict__["resume"]

    @functools.wraps(original)
    def resume(self: Any, checkpoint: str, resume_optimizer: bool = True, map_location: Any = "default") -> Any:
        if map_location == "default" and not torch.cuda.is_available():
            map_location = "cpu"
        return original(self, checkpoint, resume_optimizer=resume_optimizer, map_location=map_location)

    cls.resume = resume
    return lambda: setattr(cls, "resume", original)


class StandIns:
    """What a block of :func:`cpu_stand_ins` can add once the plugin's classes exist (undone with the rest)."""

    def __init__(self, islands: bool, undo: List[Callable[[], None]]) -> None:
        self.islands = islands
        self._undo = undo

    def whole_forward(self, cls: type) -> None:
        """With ``islands=False``: every forward of ``cls`` under fp16 autocast (no-op with ``islands=True``)."""
        if not self.islands:
            self._undo.append(wrap_forward(cls))


def wrap_forward(cls: type) -> Callable[[], None]:
    """Runs ``cls.forward`` under CPU fp16 autocast whenever the instance has ``fp16_enabled`` (set by MMCV's
    ``wrap_fp16_model`` in ``Fp16OptimizerHook.before_run``); returns the undo. Training and the guard's replay
    (``model(**batch)``) both go through ``forward``."""
    original = cls.__dict__["forward"]

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.float16, enabled=bool(getattr(self, "fp16_enabled", False))):
            return original(self, *args, **kwargs)

    cls.forward = forward
    return lambda: setattr(cls, "forward", original)
